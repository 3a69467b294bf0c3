"""Schedule for ALBERT (transformers' Albert* modules: AlbertModel, or a model with one under
``albert``; sharding the embedding takes AlbertForMaskedLM, the model upstream Slapo's example
trains), written as the paper's listing: kernels, then Megatron-style tensor parallelism, then
activation checkpointing.

ALBERT shares its layers' weights: its encoder calls the same ``AlbertLayer`` (one per layer
group, usually one in all) once for each of the model's layers. The schedule shards and
compiles those modules once, and checkpoints the first ``round(ckpt_ratio * calls)`` of their
calls in a forward (upstream's schedule checkpointed every call for any ratio above 0). Under
DeepSpeed ZeRO-3 a compiled shared layer is no leaf module (``slapo.engines``).

ALBERT's attention module adds its residual and LayerNorm itself, so the input gradient of the
column-parallel query, key and value projections is all-reduced at each projection (three
all-reduces, where BERT's self-attention takes one for the three): an all-reduce at the
module's input would sum the residual's gradient, the same on every rank, as well. For the same
reason its probability dropout runs in a core of its own (``common.add_attention_core``) that
``fork_rng`` forks alone: the module's output dropout is on replicated activations.
Upstream's schedule replaced the attention by its ``FlashAttention`` (fresh weights, one fused
QKV projection); this one keeps transformers' modules and their weights.
"""

from __future__ import annotations

from ..op import (
    compiled_loss,
    register_hf_core_attention,
    use_device_dropout,
    use_padded_vocab,
    use_sdpa,
    vocab_parallel_loss,
)
from .common import add_attention_core, checkpoint_shared_layers, mark_shared_layers


def schedule(sch, opts) -> None:
    config, base = sch.mod.config, "albert." if hasattr(sch.mod, "albert") else ""
    layers = [sch[f"{base}encoder.albert_layer_groups.{group}.albert_layers.{i}"]
              for group in range(config.num_hidden_groups) for i in range(config.inner_group_num)]
    mark_shared_layers(layers, config.num_hidden_layers // config.num_hidden_groups)
    masked_lm = hasattr(sch.mod, "predictions") and not hasattr(sch.mod, "sop_classifier")
    if opts.kernel_opt:
        use_sdpa(sch)  # attention on SDPA
        use_device_dropout(sch)  # dropout masks drawn the way that is fast on the device
        use_padded_vocab(sch)  # the LM head's matmuls on aligned shapes (CUDA)
        if opts.compile_layers:  # Inductor regions: bias+GeLU, residuals, LayerNorms; the loss
            for layer in layers:
                layer.compile(dynamic=False, fuse_projections=True)
            if masked_lm:
                compiled_loss(sch, "masked")
    if opts.tensor_parallel and sch.world_size > 1:
        config._attn_implementation = register_hf_core_attention()
        for layer in layers:
            attn = layer["attention"]
            add_attention_core(attn, attn.mod.attention_dropout.p)
            attn["core"].fork_rng()  # attention-probability dropout on this rank's heads
            for name in ("query", "key", "value"):
                attn[name].shard("weight", axis=0)
                attn[name].sync("bwd_post", "all_reduce", overlap=[""])
            attn["dense"].shard("weight", axis=1)
            attn["dense"].sync("fwd_post", "all_reduce")
            layer["ffn"].shard("weight", axis=0)
            layer["ffn"].sync("bwd_post", "all_reduce", overlap=[""])
            layer["ffn_output"].shard("weight", axis=1)
            layer["ffn_output"].sync("fwd_post", "all_reduce")
        if opts.shard_embedding:
            if not masked_lm:
                raise NotImplementedError(
                    f"shard_embedding: the ALBERT schedule shards the LM head of an "
                    f"AlbertForMaskedLM, not of {type(sch.mod).__name__}; leave it off")
            sch[f"{base}embeddings.word_embeddings"].shard("weight", axis=0, pad=True)
            sch[f"{base}embeddings.word_embeddings"].sync("fwd_post", "all_reduce")
            sch["predictions.decoder"].shard("weight", axis=0, pad=True)  # tied: done
            sch["predictions.decoder"].sync("bwd_post", "all_reduce", overlap=[""])
            vocab_parallel_loss(sch, "masked")
    checkpoint_shared_layers(sch[f"{base}encoder"], layers, opts.ckpt_ratio)
