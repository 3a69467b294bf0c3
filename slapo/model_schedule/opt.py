"""Schedule for OPT (transformers' OPT* modules). OPT's FFN uses ReLU: no GeLU to fuse."""

from __future__ import annotations

from ..op import compiled_loss, use_device_dropout, use_sdpa, vocab_parallel_loss
from . import checkpoint_layers


def schedule(sch, opts) -> None:
    layers = [sch[f"model.decoder.layers.{i}"] for i in range(sch.mod.config.num_hidden_layers)]
    if opts.kernel_opt:
        use_sdpa(sch)  # attention on SDPA
        use_device_dropout(sch)  # dropout masks drawn the way that is fast on the device
        if opts.compile_layers:  # one Inductor region a layer: ReLU, residual, LayerNorm, dropout
            for layer in layers:
                layer.compile(dynamic=False, fuse_projections=True)
            compiled_loss(sch, "causal")  # the loss in one Inductor region
    if opts.tensor_parallel and sch.world_size > 1:
        for layer in layers:
            attn = layer["self_attn"]
            for name in ("q_proj", "k_proj", "v_proj"):
                attn[name].shard("weight", axis=0)
            attn.sync("bwd_post", "all_reduce", overlap=["q_proj", "k_proj", "v_proj"])
            attn.mod.num_heads //= sch.world_size
            attn.fork_rng()  # attention-probability dropout on this rank's heads
            attn["out_proj"].shard("weight", axis=1)
            attn["out_proj"].sync("fwd_post", "all_reduce")
            layer["fc1"].shard("weight", axis=0)
            layer["fc1"].sync("bwd_post", "all_reduce", overlap=[""])
            layer["fc2"].shard("weight", axis=1)
            layer["fc2"].sync("fwd_post", "all_reduce")
        if opts.shard_embedding:
            sch["model.decoder.embed_tokens"].shard("weight", axis=0, pad=True)
            sch["model.decoder.embed_tokens"].sync("fwd_post", "all_reduce")
            sch["lm_head"].shard("weight", axis=0, pad=True)  # tied: done
            sch["lm_head"].sync("bwd_post", "all_reduce", overlap=[""])
            vocab_parallel_loss(sch, "causal")
    checkpoint_layers(layers, opts.ckpt_ratio)
