"""Schedule for LLaMA (transformers' Llama* modules). Query and key/value heads shard alike,
so grouped-query attention keeps its group size; the SwiGLU FFN has no GeLU to fuse."""

from __future__ import annotations

from . import checkpoint_layers
from .common import shard_attention, shard_column_row, shard_vocab, tensor_parallel, use_kernels


def schedule(sch, opts) -> None:
    layers = [sch[f"model.layers.{i}"] for i in range(sch.mod.config.num_hidden_layers)]
    if opts.kernel_opt:
        use_kernels(sch)
    if tensor_parallel(sch, opts):
        for layer in layers:
            shard_attention(layer["self_attn"], ["q_proj", "k_proj", "v_proj"], "o_proj")
            shard_column_row(layer["mlp"], ["gate_proj", "up_proj"], "down_proj")
        if opts.shard_embedding:
            shard_vocab(sch, ["model.embed_tokens"], "lm_head", loss="causal")
    checkpoint_layers(sch, [layer.path for layer in layers], opts.ckpt_ratio)
