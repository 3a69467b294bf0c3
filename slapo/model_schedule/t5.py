"""Schedule for T5 (transformers' T5* modules): encoder and decoder stacks of blocks whose
``layer[0]`` is self-attention, ``layer[1]`` (decoder) cross-attention and ``layer[-1]`` the
FFN. Both stacks count as layers for the checkpoint ratio, encoder blocks first."""

from __future__ import annotations

from ..op import compiled_loss, use_device_dropout, use_sdpa, vocab_parallel_loss
from . import checkpoint_layers
from .common import all_reduce_output_grad


def schedule(sch, opts) -> None:
    blocks = [sch[f"{s}.block.{i}"] for s in ("encoder", "decoder")
              for i in range(len(sch[s].mod.block))]
    attns = [n for b in blocks for _, n in b.named_schedules() if n.name.endswith("Attention")]
    if opts.kernel_opt:
        use_sdpa(sch)  # attention on SDPA
        use_device_dropout(sch)  # dropout masks drawn the way that is fast on the device
        if opts.compile_layers:  # one Inductor region a block: RMSNorm, residual, FFN act
            for block in blocks:
                block.compile(dynamic=False, fuse_projections=True)
            compiled_loss(sch, "seq2seq")  # the loss in one Inductor region
    if opts.tensor_parallel and sch.world_size > 1:
        for attn in attns:  # self-attention and (decoder) cross-attention
            for name in ("q", "k", "v"):
                attn[name].shard("weight", axis=0)
            attn.sync("bwd_post", "all_reduce", overlap=["q", "k", "v"])
            attn.mod.n_heads //= sch.world_size
            attn.mod.inner_dim //= sch.world_size
            attn.fork_rng()  # attention-probability dropout on this rank's heads
            attn["o"].shard("weight", axis=1)
            attn["o"].sync("fwd_post", "all_reduce")
            if attn.mod.has_relative_attention_bias:  # one bias per head
                attn["relative_attention_bias"].shard("weight", axis=1)
        for ffn in [b[f"layer.{len(b.mod.layer) - 1}.DenseReluDense"] for b in blocks]:
            wi = ["wi"] if "wi" in ffn.child else ["wi_0", "wi_1"]  # gated-GeLU T5: two
            for name in wi:
                ffn[name].shard("weight", axis=0)
            ffn.sync("bwd_post", "all_reduce", overlap=wi)
            ffn.fork_rng()  # its dropout acts on sharded activations
            ffn["wo"].shard("weight", axis=1)
            ffn["wo"].sync("fwd_post", "all_reduce")
        # the decoder's cross-attention K and V read the encoder output: one all-reduce
        all_reduce_output_grad(sch["encoder"])
        if opts.shard_embedding:
            for path in ("encoder.embed_tokens", "decoder.embed_tokens"):  # tied: one weight
                sch[path].shard("weight", axis=0, pad=True)
                sch[path].sync("fwd_post", "all_reduce")
            sch["lm_head"].shard("weight", axis=0, pad=True)
            sch["lm_head"].sync("bwd_post", "all_reduce", overlap=[""])
            vocab_parallel_loss(sch, "seq2seq")
    checkpoint_layers(blocks, opts.ckpt_ratio)
