"""Schedule for OPT (transformers' OPT* modules). OPT's FFN uses ReLU: no GeLU to fuse."""

from __future__ import annotations

from . import checkpoint_layers
from .common import shard_attention, shard_column_row, shard_vocab, tensor_parallel, use_kernels


def schedule(sch, opts) -> None:
    layers = [sch[f"model.decoder.layers.{i}"] for i in range(sch.mod.config.num_hidden_layers)]
    if opts.kernel_opt:
        use_kernels(sch)
    if tensor_parallel(sch, opts):
        for layer in layers:
            shard_attention(layer["self_attn"], ["q_proj", "k_proj", "v_proj"], "out_proj",
                            heads=("num_heads",))
            shard_column_row(layer, ["fc1"], "fc2", input_sync="fc1")
        if opts.shard_embedding:
            shard_vocab(sch, ["model.decoder.embed_tokens"], "lm_head", loss="causal")
    checkpoint_layers(sch, [layer.path for layer in layers], opts.ckpt_ratio)
