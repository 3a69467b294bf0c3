"""Hook plumbing shared by primitives: tensors inside module inputs/outputs, post-op chains."""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from . import state


def outside_graphs(fn: Callable | None = None, *, recursive: bool = True) -> Callable:
    """``fn``, run eagerly when a ``torch.compile`` region calls it (``torch.compiler.disable``):
    for what slapo inserts into a forward that a graph must not hold (collectives, random
    streams, checkpoint recomputation, and the state they keep by object identity). The
    region breaks around the call instead of guarding on that state or failing to trace it.
    ``recursive=False`` keeps only ``fn``'s own frame eager: the functions it calls (a
    wrapped module forward) are compiled again as regions of their own."""
    if fn is None:  # used as @outside_graphs(recursive=False)
        return functools.partial(outside_graphs, recursive=recursive)
    return torch.compiler.disable(fn, recursive=recursive)


def map_first_tensor(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``fn`` to ``value`` if it is a tensor, else to the first tensor of a tuple/list
    (HF modules return tuples such as ``(attn_output, attn_weights)``) or of a ModelOutput."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            if isinstance(item, torch.Tensor):
                items = list(value)
                items[i] = fn(item)
                return type(value)(items) if isinstance(value, list) else tuple(items)
        raise TypeError("no tensor among the module's outputs")
    if isinstance(value, dict):  # transformers' ModelOutput is an ordered dict
        for key, item in value.items():
            if isinstance(item, torch.Tensor):
                value[key] = fn(item)
                return value
    raise TypeError(f"cannot find a tensor in a {type(value).__name__}")


def map_first_input(args: tuple, kwargs: dict, fn: Callable) -> tuple[tuple, dict]:
    """Apply ``fn`` to the first tensor argument of a call (positional first, then keyword)."""
    for i, arg in enumerate(args):
        if isinstance(arg, torch.Tensor):
            return args[:i] + (fn(arg),) + args[i + 1:], kwargs
    for key, arg in kwargs.items():
        if isinstance(arg, torch.Tensor):
            return args, {**kwargs, key: fn(arg)}
    raise TypeError("the module was called without a tensor argument")


def post_chain(module: nn.Module) -> list[Callable]:
    """The ordered list of output hooks run after a module's forward.

    Each entry is called as a forward hook, ``hook(module, args, output)``, and returns the
    new output (or None to keep it); ``on_first_tensor(fn)`` makes one from a tensor function.
    One forward hook runs the whole chain, then adds a bias that sharding deferred (the bias of
    a row-parallel layer must be added once, after the partial outputs are reduced).
    """
    chain = state.post_chain_of(module)
    if chain is None:
        chain = []
        state.set_post_chain(module, chain)
        module.register_forward_hook(_run_post_chain)
    return chain


def on_first_tensor(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
    """An output hook for ``post_chain`` that applies ``fn`` to the output's first tensor."""
    return lambda module, args, output: map_first_tensor(output, fn)


def defer_bias(module: nn.Module) -> None:
    """Add ``module.bias`` after the post chain instead of inside the forward."""
    post_chain(module)
    state.mark_deferred_bias(module)


def _run_post_chain(module: nn.Module, args, output):
    for hook in state.post_chain_of(module):
        result = hook(module, args, output)
        output = output if result is None else result
    if state.has_deferred_bias(module) and module.bias is not None:
        bias = module.bias
        output = map_first_tensor(output, lambda t: t + _channel_view(bias, module, t))
    return output


def _channel_view(bias: torch.Tensor, module: nn.Module, out: torch.Tensor) -> torch.Tensor:
    # Linear: the bias broadcasts along the last axis; ConvNd: along the channel axis 1.
    if isinstance(module, nn.modules.conv._ConvNd):
        return bias.view(1, -1, *([1] * (out.dim() - 2)))
    return bias


# A module's hooks as torch keeps them: the ordered dicts of hooks by handle id, and the dicts
# (handle id -> True) that mark how each is called.
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks")
_HOOK_FLAGS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called")
HOOK_KINDS = {"fwd_pre": ("_forward_pre_hooks",), "fwd_post": ("_forward_hooks",),
              "bwd_post": ("_backward_hooks", "_backward_pre_hooks")}


def move_hooks(old: nn.Module, new: nn.Module, kinds=tuple(HOOK_KINDS),
               keep: Callable[[Callable], bool] = lambda hook: True) -> None:
    """Move ``old``'s hooks of ``kinds`` (``"fwd_pre"``, ``"fwd_post"``, ``"bwd_post"``) for
    which ``keep(hook)`` holds onto ``new``, ahead of ``new``'s own, each called as it was
    (with kwargs, always called, full backward hook); a forward post-op chain (``sync``)
    moves with the forward hooks. ``new`` then runs them where ``old`` did."""
    for kind in kinds:
        for attr in HOOK_KINDS[kind]:
            moved = OrderedDict((i, h) for i, h in getattr(old, attr).items() if keep(h))
            if not moved:
                continue
            for i in moved:
                del getattr(old, attr)[i]
            merged = OrderedDict(moved)
            merged.update(getattr(new, attr))
            setattr(new, attr, merged)
            for flag in _HOOK_FLAGS:
                marks = getattr(old, flag)
                getattr(new, flag).update({i: marks.pop(i) for i in moved if i in marks})
            if attr == "_backward_hooks":
                new._is_full_backward_hook = old._is_full_backward_hook
    if "fwd_post" in kinds and (chain := state.post_chain_of(old)) is not None:
        state.set_post_chain(new, chain)
        if state.has_deferred_bias(old):
            state.mark_deferred_bias(new)
