"""Schedule for T5 (transformers' T5* modules): encoder and decoder stacks of blocks whose
``layer[0]`` is self-attention, ``layer[1]`` (decoder) cross-attention and ``layer[-1]`` the
FFN. Both stacks count as layers for the checkpoint ratio, encoder blocks first."""

from __future__ import annotations

from . import checkpoint_layers
from .common import (
    all_reduce_output_grad,
    shard_attention,
    shard_column_row,
    shard_vocab,
    tensor_parallel,
    use_kernels,
)


def schedule(sch, opts) -> None:
    blocks = [sch[f"{s}.block.{i}"] for s in ("encoder", "decoder")
              for i in range(len(sch[s].mod.block))]
    attns = [n for b in blocks for _, n in b.named_schedules() if n.name.endswith("Attention")]
    if opts.kernel_opt:
        use_kernels(sch)
    if tensor_parallel(sch, opts):
        for attn in attns:
            shard_attention(attn, ["q", "k", "v"], "o", heads=("n_heads", "inner_dim"))
            if attn.mod.has_relative_attention_bias:
                attn["relative_attention_bias"].shard("weight", axis=1)
        for ffn in [b[f"layer.{len(b.mod.layer) - 1}.DenseReluDense"] for b in blocks]:
            shard_column_row(ffn, ["wi"] if "wi" in ffn.child else ["wi_0", "wi_1"], "wo")
            ffn.fork_rng()
        all_reduce_output_grad(sch["encoder"])
        if opts.shard_embedding:
            shard_vocab(sch, ["encoder.embed_tokens", "decoder.embed_tokens"], "lm_head", "seq2seq")
    checkpoint_layers(sch, [block.path for block in blocks], opts.ckpt_ratio)
