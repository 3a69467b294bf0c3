"""Schedule for LLaMA (transformers' Llama* modules). Query and key/value heads shard alike,
so grouped-query attention keeps its group size; the SwiGLU FFN has no GeLU to fuse."""

from __future__ import annotations

from ..op import compiled_loss, use_device_dropout, use_sdpa, vocab_parallel_loss
from . import checkpoint_layers


def schedule(sch, opts) -> None:
    layers = [sch[f"model.layers.{i}"] for i in range(sch.mod.config.num_hidden_layers)]
    if opts.kernel_opt:
        use_sdpa(sch)  # attention on SDPA
        use_device_dropout(sch)  # dropout masks drawn the way that is fast on the device
        if opts.compile_layers:  # one Inductor region a layer: RMSNorm, RoPE, SwiGLU fused
            for layer in layers:
                layer.compile(dynamic=False, fuse_projections=True)
            compiled_loss(sch, "causal")  # the loss in one Inductor region
    if opts.tensor_parallel and sch.world_size > 1:
        for layer in layers:
            attn = layer["self_attn"]  # its forward infers the head count from the shapes
            for name in ("q_proj", "k_proj", "v_proj"):
                attn[name].shard("weight", axis=0)
            attn.sync("bwd_post", "all_reduce", overlap=["q_proj", "k_proj", "v_proj"])
            attn.fork_rng()  # attention-probability dropout on this rank's heads
            attn["o_proj"].shard("weight", axis=1)
            attn["o_proj"].sync("fwd_post", "all_reduce")
            mlp = layer["mlp"]
            mlp["gate_proj"].shard("weight", axis=0)
            mlp["up_proj"].shard("weight", axis=0)
            mlp.sync("bwd_post", "all_reduce", overlap=["gate_proj", "up_proj"])
            mlp["down_proj"].shard("weight", axis=1)
            mlp["down_proj"].sync("fwd_post", "all_reduce")
        if opts.shard_embedding:
            sch["model.embed_tokens"].shard("weight", axis=0, pad=True)
            sch["model.embed_tokens"].sync("fwd_post", "all_reduce")
            sch["lm_head"].shard("weight", axis=0, pad=True)
            sch["lm_head"].sync("bwd_post", "all_reduce", overlap=[""])
            vocab_parallel_loss(sch, "causal")
    checkpoint_layers(layers, opts.ckpt_ratio)
