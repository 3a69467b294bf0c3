"""Pieces of schedule that more than one family's schedule would otherwise repeat, each
specific to a kind of model. Table 4 counts each one a family's schedule calls with that
schedule (``slapo_ae.analysis.loc``); what applies to any model (kernels and their
installers, the vocabulary-parallel loss) is library code in ``slapo.op``.

- ``shard_batchnorm``: a BatchNorm over sharded channels (parameters and running statistics);
- ``all_reduce_output_grad``: one backward all-reduce on an output that column-parallel
  projections elsewhere read (T5's encoder output);
- ``sdpa_gpt_neo``: GPT-Neo's attention core on ``slapo.op.CoreAttention`` (SDPA);
- ``add_attention_core``: an attention's core as a child of its own, so that ``fork_rng`` can
  address its probability dropout alone (GPT-2 and ALBERT, which draw it in a function);
- ``mark_shared_layers``, ``checkpoint_shared_layers``: layers a model calls more than once
  a forward (ALBERT's shared layers), noted as such, and the first of their calls
  checkpointed;
- ``fuse_bias_gelu``: BERT's and RoBERTa's FFN bias add and GeLU fused (the static-graph path);
- ``bottleneck_blocks``: WideResNet's blocks (its schedule's, and ``apply_schedule``'s
  ``fuse_conv``).

Apply kernel replacements (``slapo.op.use_sdpa``, ``use_device_dropout``, ``sdpa_gpt_neo``,
trace/fuse) before sharding and before ``fork_rng``/``checkpoint``: ``replace`` installs a new
module, and what was attached to the old one (hooks, wrapped forwards) would not carry over.
"""

from __future__ import annotations

import functools
import types

import torch.nn.functional as F

from .. import state
from ..hooks import outside_graphs
from ..op import CoreAttention, kernel_compiler
from ..primitives.checkpoint import checkpoint_call
from ..sharding import all_reduce_backward


def shard_batchnorm(bn) -> None:
    """Shard a BatchNorm over channels split across ranks: per-channel statistics need no
    communication (each rank normalises its channels over the whole batch), so the affine
    parameters and the running statistics are simply sliced."""
    bn.shard(["weight", "bias"], axis=0)
    mod, world, rank = bn.mod, bn.world_size, bn.rank
    for name in ("running_mean", "running_var"):
        buf = getattr(mod, name, None)
        if buf is not None:
            setattr(mod, name, buf.chunk(world)[rank].clone())
    mod.num_features //= world


def _gpt_neo_attn(self, query, key, value, attention_mask=None):
    """GPTNeoSelfAttention._attn on SDPA: the layer's causal (or local-window) mask, no
    scaling, the model's padding mask; q and k stay in their dtype (HF upcasts them to fp32)."""
    return self.core(query, key, value, attention_mask), None


def sdpa_gpt_neo(attn) -> None:
    """Give a GPTNeoSelfAttention an SDPA core: child ``core`` (a ``CoreAttention`` with the
    layer's window, scale 1.0 and probability dropout) computes what ``_attn`` did."""
    mod = attn.mod
    window = mod.config.window_size if mod.attention_type == "local" else None
    mod.core = CoreAttention(causal=True, window=window, scale=1.0, dropout=mod.attn_dropout.p)
    mod._attn = types.MethodType(_gpt_neo_attn, mod)
    attn._rebuild_children()


def add_attention_core(attn, dropout: float) -> None:
    """Give the attention ``attn`` (transformers' attention-interface module: ``is_causal``,
    ``scaling``) a child ``core``, a ``CoreAttention`` with its causality, scale and
    probability ``dropout``, which ``slapo.op.register_hf_core_attention``'s interface runs."""
    mod = attn.mod
    mod.core = CoreAttention(causal=mod.is_causal, scale=mod.scaling, dropout=dropout)
    attn._rebuild_children()


def mark_shared_layers(layers: list, calls_each: int) -> None:
    """Note that a forward runs each module of ``layers`` ``calls_each`` times (ALBERT's
    shared layers), for the engines that must know (ZeRO-3 makes no leaf module of one)."""
    for layer in layers:
        state.set_calls_per_forward(layer.mod, calls_each)


def checkpoint_shared_layers(caller, layers: list, ratio: float) -> None:
    """Checkpoint the first ``round(ratio * calls)`` of the calls that each forward of
    ``caller`` makes to the modules of ``layers`` (ALBERT's encoder calls its one shared layer
    once per layer of the model), counted across them, ``calls`` the sum of their
    ``mark_shared_layers`` counts; all of them with the ``checkpoint`` primitive."""
    calls = sum(state.calls_per_forward(layer.mod) for layer in layers)
    count = round(ratio * calls)
    if count >= calls:
        for layer in layers:
            layer.checkpoint()
        return
    if count <= 0:
        return
    made = [0]  # calls so far in this forward of caller
    # a new forward starts the count again; so does a recomputation of the caller's forward
    # (caller checkpointed too), which runs no hooks: hence the count modulo calls as well
    caller.mod.register_forward_pre_hook(lambda *_: made.__setitem__(0, 0))
    for layer in layers:
        inner = layer.mod.forward

        @outside_graphs(recursive=False)  # as the primitive's: a compiled forward inside
        @functools.wraps(inner)
        def forward(*args, _inner=inner, **kwargs):
            made[0] = made[0] % calls + 1
            if made[0] <= count:
                return checkpoint_call(_inner, *args, **kwargs)
            return _inner(*args, **kwargs)

        layer.mod.forward = forward


def all_reduce_output_grad(node) -> None:
    """All-reduce, in the backward, the gradient of ``node``'s (first) output: for an output
    consumed only by column-parallel projections elsewhere (T5's encoder output, read by the
    decoder's cross-attention keys and values), one all-reduce replaces one per consumer."""
    group = node.group
    node.sync("fwd_post", lambda out: all_reduce_backward(out, group))


def _bias_gelu(x, bias):  # the pattern ``find`` looks for in the traced FFN
    return F.gelu(x + bias)


def fuse_bias_gelu(layers, device: str) -> None:
    """Fuse the bias add and GeLU of each layer's FFN (``intermediate``: trace it, decompose
    its Linear, ``find`` the pattern and ``fuse`` it), compiled with
    ``slapo.op.kernel_compiler(device)``: Inductor on CUDA, uncompiled on CPU. On CUDA with
    nothing to compile it (``SLAPO_COMPILE_KERNELS=0``) nothing is rewritten: the Linear keeps
    its bias in cuBLAS's epilogue, where an uncompiled fusion would only add a kernel."""
    compiler = kernel_compiler(device)
    if device != "cpu" and compiler is None:
        return
    for layer in layers:
        ffn = layer["intermediate"]
        ffn.trace(flatten=True)
        ffn["dense"].decompose()
        ffn.fuse(ffn.find(_bias_gelu, allow_empty=False)[0], compiler=compiler, name="bias_gelu")


def bottleneck_blocks(sch) -> list:
    """The schedules of the blocks ``layer1.0`` .. ``layer4.N`` of the WideResNet at ``sch``
    (the zoo's, or torchvision's, which has no config), read from its modules."""
    return [sch[f"layer{k}.{j}"] for k in range(1, 5) for j in range(len(sch[f"layer{k}"].mod))]
