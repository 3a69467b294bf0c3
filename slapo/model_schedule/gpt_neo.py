"""Schedule for GPT-Neo (transformers' GPTNeo* modules), written as the paper's listing:
kernels, then Megatron-style tensor parallelism, then activation checkpointing."""

from __future__ import annotations

import math

import torch

from ..op import (
    bias_gelu,
    compiled_loss,
    use_device_dropout,
    use_padded_vocab,
    use_sdpa,
    vocab_parallel_loss,
)
from . import checkpoint_layers
from .common import sdpa_gpt_neo


def bias_gelu_tanh(x, bias):  # transformers' NewGELUActivation after the bias add
    y = x + bias
    inner = math.sqrt(2.0 / math.pi) * (y + 0.044715 * torch.pow(y, 3.0))
    return 0.5 * y * (1.0 + torch.tanh(inner))


def gelu_kernel(x, bias):
    # One aten GeLU (compiled on CUDA). On CPU the formula's eight ops after the bias add,
    # fused uncompiled, cost 3.4 ms forward and backward at 8x128x256 against 2.2 ms for this.
    return bias_gelu(x, bias, approximate="tanh")


def schedule(sch, opts) -> None:
    layers = [sch[f"transformer.h.{i}"] for i in range(sch.mod.config.num_layers)]
    if opts.kernel_opt:
        use_sdpa(sch)
        use_device_dropout(sch)  # dropout masks drawn the way that is fast on the device
        use_padded_vocab(sch)  # the LM head's matmuls on aligned shapes (CUDA)
        if opts.compile_layers:
            compiled_loss(sch, "causal")  # the loss in one Inductor region
        for layer in layers:
            sdpa_gpt_neo(layer["attn.attention"])  # the attention core on SDPA
            if opts.compile_layers:  # one Inductor region: tanh-GeLU, residual, LayerNorm
                layer.compile(dynamic=False, fuse_projections=True)
                continue
            mlp = layer["mlp"]
            mlp.trace(flatten=True)
            mlp["c_fc"].decompose()
            mlp.replace(gelu_kernel, subgraph=mlp.find(bias_gelu_tanh, allow_empty=False)[0],
                        name="bias_gelu")
    if opts.tensor_parallel and sch.world_size > 1:
        for layer in layers:
            attn = layer["attn.attention"]
            for name in ("q_proj", "k_proj", "v_proj"):
                attn[name].shard("weight", axis=0)
            attn.sync("bwd_post", "all_reduce", overlap=["q_proj", "k_proj", "v_proj"])
            attn.mod.num_heads //= sch.world_size
            # attention-probability dropout on this rank's heads: in the SDPA core, or HF's
            attn["core" if opts.kernel_opt else "attn_dropout"].fork_rng()
            attn["out_proj"].shard("weight", axis=1)
            attn["out_proj"].sync("fwd_post", "all_reduce")
            mlp = layer["mlp"]
            mlp["c_fc"].shard("weight", axis=0)
            mlp.sync("bwd_post", "all_reduce", overlap=["c_fc"])
            mlp["c_proj"].shard("weight", axis=1)
            mlp["c_proj"].sync("fwd_post", "all_reduce")
        if opts.shard_embedding:
            sch["transformer.wte"].shard("weight", axis=0, pad=True)
            sch["transformer.wte"].sync("fwd_post", "all_reduce")
            sch["lm_head"].shard("weight", axis=0, pad=True)  # tied: done
            sch["lm_head"].sync("bwd_post", "all_reduce", overlap=[""])
            vocab_parallel_loss(sch, "causal")
    checkpoint_layers(layers, opts.ckpt_ratio)
