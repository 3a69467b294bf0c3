"""Schedule for BERT (transformers' Bert* modules)."""

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


def shard_bert(sch, prefix: str = "bert", shard_embedding: bool = True,
               vocab_parallel_loss: bool = False) -> None:
    """Megatron-style tensor parallelism of a BERT encoder over the schedule's group.

    Attention heads and the FFN are split across ranks (QKV and the first FFN linear by
    columns, the output projections by rows), attention-probability dropout draws per rank,
    and the word embedding is split by vocabulary. The MLM head (tied to the word embedding)
    then yields this rank's vocabulary slice: gathered to full logits, or, with
    ``vocab_parallel_loss``, kept sharded and the loss computed on the slices.
    """
    config = sch[prefix].mod.config
    for i in range(config.num_hidden_layers):
        layer = sch[f"{prefix}.encoder.layer.{i}"]
        shard_attention(layer["attention"], ["self.query", "self.key", "self.value"],
                        "output.dense", dropout="self", input_sync="self")
        shard_column_row(layer, ["intermediate.dense"], "output.dense", input_sync="intermediate")
    if shard_embedding:
        shard_vocab(sch, [f"{prefix}.embeddings.word_embeddings"], "cls.predictions.decoder",
                    loss="masked" if vocab_parallel_loss else None)


def schedule(sch, opts) -> None:
    layers = [f"bert.encoder.layer.{i}" for i in range(sch["bert"].mod.config.num_hidden_layers)]
    if opts.kernel_opt:
        use_kernels(sch)
        for path in layers:
            fuse_bias_gelu(sch[f"{path}.intermediate.dense"],
                           sch[f"{path}.intermediate.intermediate_act_fn"])
    if tensor_parallel(sch, opts):
        shard_bert(sch, shard_embedding=opts.shard_embedding, vocab_parallel_loss=True)
    checkpoint_layers(sch, layers, opts.ckpt_ratio)
