"""Schedule for GPT-Neo (transformers' GPTNeo* modules)."""

from __future__ import annotations

from . import checkpoint_layers
from .common import (
    fuse_bias_gelu,
    sdpa_gpt_neo,
    shard_attention,
    shard_column_row,
    shard_vocab,
    tensor_parallel,
    use_kernels,
)


def schedule(sch, opts) -> None:
    layers = [sch[f"transformer.h.{i}"] for i in range(sch.mod.config.num_layers)]
    if opts.kernel_opt:
        use_kernels(sch)
        for layer in layers:
            sdpa_gpt_neo(layer["attn.attention"])
            fuse_bias_gelu(layer["mlp.c_fc"], layer["mlp.act"])
    if tensor_parallel(sch, opts):
        for layer in layers:
            # heads to divide; the probability dropout is in the SDPA core, or HF's attn_dropout
            shard_attention(layer["attn.attention"], ["q_proj", "k_proj", "v_proj"], "out_proj",
                            ("num_heads",), "core" if opts.kernel_opt else "attn_dropout")
            shard_column_row(layer["mlp"], ["c_fc"], "c_proj")
        if opts.shard_embedding:
            shard_vocab(sch, ["transformer.wte"], "lm_head", loss="causal")
    checkpoint_layers(sch, [layer.path for layer in layers], opts.ckpt_ratio)
