"""Schedule for GPT-2 (transformers' GPT2* modules, whose linears are ``Conv1D``: weight
``(in, out)``, so a column shard is ``axis=1`` and a row shard ``axis=0``).

Upstream Slapo's GPT-2 schedule replaces each attention with its ``FlashAttention`` and each
MLP with its ``FusedMLP`` (fresh weights), then shards those. This one keeps transformers'
modules and their weights: ``c_attn`` computes q, k and v side by side, so it is sharded in
three parts (each rank keeps the q, k and v columns of its own heads) and the layer's
``split_size`` and ``num_heads`` are divided. Tensor parallelism gives each attention a
``core`` child (``CoreAttention`` on SDPA, through transformers' attention interface), because
GPT-2 draws its probability dropout in a function, not a module, and ``fork_rng`` needs a node.
"""

from __future__ import annotations

from torch import nn

from ..op import (
    Conv1DGeLU,
    gelu_approximation,
    register_hf_core_attention,
    use_device_dropout,
    use_padded_vocab,
    use_sdpa,
    vocab_parallel_loss,
)
from . import checkpoint_layers
from .common import add_attention_core


def schedule(sch, opts) -> None:
    config, base = sch.mod.config, "transformer." if hasattr(sch.mod, "transformer") else ""
    layers = [sch[f"{base}h.{i}"] for i in range(config.n_layer)]
    if opts.kernel_opt:
        use_sdpa(sch)  # attention on SDPA
        use_device_dropout(sch)  # dropout masks drawn the way that is fast on the device
        use_padded_vocab(sch)  # the LM head's matmuls on aligned shapes (CUDA)
        for layer in layers:
            _fuse_conv1d_gelu(layer["mlp.c_fc"], layer["mlp.act"])
    if opts.tensor_parallel and sch.world_size > 1:
        config._attn_implementation = register_hf_core_attention()
        for layer in layers:
            attn, mlp = layer["attn"], layer["mlp"]
            add_attention_core(attn, attn.mod.attn_dropout.p)
            attn["c_attn"].shard("weight", axis=1, parts=3)  # q, k, v of my heads; bias too
            attn.sync("bwd_post", "all_reduce")
            attn.mod.num_heads //= sch.world_size
            attn.mod.split_size //= sch.world_size
            attn["core"].fork_rng()  # attention-probability dropout on this rank's heads
            attn["c_proj"].shard("weight", axis=0)
            attn["c_proj"].sync("fwd_post", "all_reduce")
            mlp["c_fc"].shard("weight", axis=1)
            mlp.sync("bwd_post", "all_reduce")
            mlp["c_proj"].shard("weight", axis=0)
            mlp["c_proj"].sync("fwd_post", "all_reduce")
        if opts.shard_embedding and hasattr(sch.mod, "lm_head"):
            sch[f"{base}wte"].shard("weight", axis=0, pad=True)
            sch[f"{base}wte"].sync("fwd_post", "all_reduce")
            sch["lm_head"].shard("weight", axis=0, pad=True)  # tied: done
            sch["lm_head"].sync("bwd_post", "all_reduce")
            vocab_parallel_loss(sch, "causal")
    checkpoint_layers(layers, opts.ckpt_ratio)


def _fuse_conv1d_gelu(conv, act) -> None:
    """``conv`` (a Conv1D feeding the GeLU module ``act``) becomes ``slapo.op.Conv1DGeLU``."""
    approximate = gelu_approximation(act.mod)
    if approximate is None:
        raise ValueError(f"{act.path} is a {type(act.mod).__name__}, not a GeLU to fuse")
    conv.replace(Conv1DGeLU.from_conv1d(conv.mod, approximate))
    act.replace(nn.Identity())


def gen_embedding_hooks(sch, vocab_size: int):
    """Upstream Slapo's hooks for a word embedding sharded by vocabulary, as its scripts
    install them: ``sch["wte"].sync("fwd_pre", pre)`` and ``sync("fwd_post", post)`` after
    ``shard("weight", axis=0)``. ``pre`` makes the ids this rank's (its rows of
    ``vocab_size``; others to 0), which the sharded embedding, given a ``fwd_pre`` hook, looks
    up as they are; ``post`` zeroes the rows of other ranks' ids and all-reduces the partial
    embeddings over the schedule's group."""
    from ..sharding import reduce_forward_output

    start = sch.rank * vocab_size // sch.world_size
    end = (sch.rank + 1) * vocab_size // sch.world_size
    call = {}  # the ids' mask of this call, for post (which sees the local ids)

    def fwd_pre_hook(_module, args):
        call["outside"] = outside = (args[0] < start) | (args[0] >= end)
        return (args[0] - start).masked_fill(outside, 0)

    def fwd_post_hook(_module, _args, output):
        output = output.masked_fill(call.pop("outside").unsqueeze(-1), 0.0)
        return reduce_forward_output(output, sch.group)

    return fwd_pre_hook, fwd_post_hook
