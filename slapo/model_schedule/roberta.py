"""Schedule for RoBERTa (transformers' Roberta* modules; BERT's layer structure)."""

from __future__ import annotations

from . import checkpoint_layers
from .common import (
    fuse_bias_gelu,
    shard_attention,
    shard_column_row,
    shard_vocab,
    tensor_parallel,
    use_kernels,
)


def schedule(sch, opts) -> None:
    config = sch["roberta"].mod.config
    layers = [sch[f"roberta.encoder.layer.{i}"] for i in range(config.num_hidden_layers)]
    if opts.kernel_opt:
        use_kernels(sch)
        for layer in layers:
            fuse_bias_gelu(layer["intermediate.dense"], layer["intermediate.intermediate_act_fn"])
    if tensor_parallel(sch, opts):
        for layer in layers:
            shard_attention(layer["attention"], ["self.query", "self.key", "self.value"],
                            "output.dense", dropout="self", input_sync="self")
            shard_column_row(layer, ["intermediate.dense"], "output.dense",
                             input_sync="intermediate")
        if opts.shard_embedding:
            shard_vocab(sch, ["roberta.embeddings.word_embeddings"], "lm_head.decoder",
                        loss="masked")
    checkpoint_layers(sch, [layer.path for layer in layers], opts.ckpt_ratio)
