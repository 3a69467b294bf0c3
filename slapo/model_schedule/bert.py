"""Schedule for BERT (transformers' Bert* modules), written as the paper's listing:
kernels, then Megatron-style tensor parallelism, then activation checkpointing."""

from __future__ import annotations

from ..op import (
    compiled_loss,
    use_device_dropout,
    use_padded_vocab,
    use_sdpa,
    vocab_parallel_loss,
)
from . import checkpoint_layers
from .common import fuse_bias_gelu


def schedule(sch, opts) -> None:
    layers = [sch[f"bert.encoder.layer.{i}"]
              for i in range(sch["bert"].mod.config.num_hidden_layers)]
    if opts.kernel_opt:
        use_sdpa(sch)  # attention on SDPA
        use_device_dropout(sch)  # dropout masks drawn the way that is fast on the device
        use_padded_vocab(sch)  # the LM head's matmuls on aligned shapes (CUDA)
        if opts.compile_layers:  # Inductor regions: bias+GeLU, residual, LayerNorm; the loss
            for layer in layers:
                layer.compile(dynamic=False, fuse_projections=True)
            sch["cls.predictions.transform"].compile(dynamic=False)
            compiled_loss(sch, "masked")
        else:
            fuse_bias_gelu(layers, opts.device)  # FFN bias add and GeLU fused
    if opts.tensor_parallel and sch.world_size > 1:
        for layer in layers:
            attn = layer["attention"]
            for name in ("query", "key", "value"):
                attn[f"self.{name}"].shard("weight", axis=0)
            attn["self"].sync("bwd_post", "all_reduce", overlap=["query", "key", "value"])
            attn["self"].fork_rng()  # attention-probability dropout on this rank's heads
            attn["output.dense"].shard("weight", axis=1)
            attn["output.dense"].sync("fwd_post", "all_reduce")
            layer["intermediate.dense"].shard("weight", axis=0)
            layer["intermediate"].sync("bwd_post", "all_reduce", overlap=["dense"])
            layer["output.dense"].shard("weight", axis=1)
            layer["output.dense"].sync("fwd_post", "all_reduce")
        if opts.shard_embedding:
            sch["bert.embeddings.word_embeddings"].shard("weight", axis=0, pad=True)
            sch["bert.embeddings.word_embeddings"].sync("fwd_post", "all_reduce")
            sch["cls.predictions.decoder"].shard("weight", axis=0, pad=True)  # tied: done
            sch["cls.predictions.decoder"].sync("bwd_post", "all_reduce", overlap=[""])
            vocab_parallel_loss(sch, "masked")
    checkpoint_layers(layers, opts.ckpt_ratio)
