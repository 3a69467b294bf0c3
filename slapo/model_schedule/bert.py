"""Schedule for BERT (transformers' Bert* modules)."""

from __future__ import annotations

from . import checkpoint_layers


def shard_bert(sch, prefix: str = "bert", shard_embedding: bool = True) -> None:
    """Megatron-style tensor parallelism of a BERT encoder over the schedule's group.

    Attention heads and the FFN are split across ranks (QKV and the first FFN linear by
    columns, the output projections by rows), and the word embedding by vocabulary. With an
    MLM head tied to the word embedding, the head's logits are gathered to the full vocabulary.
    """
    config = sch[prefix].mod.config
    for i in range(config.num_hidden_layers):
        layer = sch[f"{prefix}.encoder.layer.{i}"]
        attn = layer["attention.self"]
        attn["query"].shard("weight", axis=0)
        attn["key"].shard("weight", axis=0)
        attn["value"].shard("weight", axis=0)
        attn.sync("bwd_post", "all_reduce")
        layer["attention.output.dense"].shard("weight", axis=1)
        layer["attention.output.dense"].sync("fwd_post", "all_reduce")
        layer["intermediate.dense"].shard("weight", axis=0)
        layer["intermediate.dense"].sync("bwd_post", "all_reduce")
        layer["output.dense"].shard("weight", axis=1)
        layer["output.dense"].sync("fwd_post", "all_reduce")
    if not shard_embedding:
        return
    sch[f"{prefix}.embeddings.word_embeddings"].shard("weight", axis=0)
    sch[f"{prefix}.embeddings.word_embeddings"].sync("fwd_post", "all_reduce")
    if "cls.predictions.decoder" in sch:
        head = sch["cls.predictions.decoder"]
        head.shard("weight", axis=0)  # a no-op when tied to the word embedding
        head.sync("bwd_post", "all_reduce")
        head.sync("fwd_post", "all_gather", axis=-1)


def schedule(sch, opts) -> None:
    config = sch["bert"].mod.config
    if opts.tensor_parallel and sch.world_size > 1:
        shard_bert(sch, shard_embedding=opts.shard_embedding)
    checkpoint_layers(sch, [f"bert.encoder.layer.{i}" for i in range(config.num_hidden_layers)],
                      opts.ckpt_ratio)
