"""checkpoint: activation checkpointing of a module."""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.fx
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from .. import state
from ..hooks import outside_graphs
from ..random import rng_streams
from . import register_primitive
from ._subgraph import CHECKPOINT_CLASS


@register_primitive()
def checkpoint(sch, subgraph=None, name: str | None = None, order_args_fn=None) -> None:
    """Recompute this module's activations in the backward instead of storing them.

    Built on ``torch.utils.checkpoint`` (non-reentrant), so keyword arguments pass through,
    and random state is restored before the recomputation: the default generator by PyTorch,
    the per-rank streams of ``fork_rng`` by slapo. Dropout therefore draws the same masks in
    the recomputation as in the forward, and gradients equal those without checkpointing.
    Without autograd (``torch.no_grad()``) the module runs as usual. Running statistics of
    batch norms are updated by the forward only, not again by the recomputation.

    The module stays where it is, with its parameter names; its class becomes a subclass
    named ``CheckPointWrapper`` (upstream Slapo's wrapper's name) whose ``mod`` is the module
    itself, so that upstream's ``sch["layer"].mod.mod`` still reaches it.

    Example::

        for i in range(config.num_hidden_layers):
            sch[f"bert.encoder.layer.{i}"].checkpoint()

    With ``subgraph`` (any form ``find`` returns: one match, a ``(path, node)``, a list of them
    taken together; or nodes of a traced graph), only that subgraph is checkpointed: it is
    extracted into a submodule of the graph module holding it, named as upstream names it,
    ``<name>_<i>`` (``CheckPointWrapper_0``, ``CheckPointWrapper_1``, ... by default;
    ``name="core"``: ``core_0``), and checkpointed as above::

        attn.checkpoint(subgraph=attn.find(attention_core_pattern)[0], name="core")

    ``order_args_fn`` (upstream's): a function of the call's ``(*args, **kwargs)`` returning
    the positional arguments the module is then called with, as upstream's reentrant
    wrapper, which could take no keyword arguments, called it (its schedules use it to drop
    ``use_cache`` and the like). Keyword arguments pass through without it.
    """
    if order_args_fn is not None and not callable(order_args_fn):
        raise TypeError(f"checkpoint at '{sch.path or '<root>'}': order_args_fn must be "
                        f"callable, got {type(order_args_fn).__name__}")
    if subgraph is not None:
        if order_args_fn is not None:
            raise ValueError(f"checkpoint at '{sch.path or '<root>'}': order_args_fn orders a "
                             "module's call; a subgraph's inputs are its own")
        from ._subgraph import checkpoint_subgraph
        checkpoint_subgraph(sch, subgraph, name, checkpoint)
        return
    mod = sch.mod
    if state.is_checkpointed(mod):
        return
    inner = mod.forward

    @outside_graphs(recursive=False)  # its RNG replay cannot be traced; ``inner`` compiles
    @functools.wraps(inner)
    def forward(*args, **kwargs):
        if order_args_fn is not None:
            args, kwargs = tuple(order_args_fn(*args, **kwargs)), {}
        return _checkpointed(inner, mod, args, kwargs)

    mod.forward = forward
    state.mark_checkpointed(mod)
    _name_as_upstreams_wrapper(mod)


# Upstream Slapo wrapped a checkpointed module in a ``CheckPointWrapper`` holding it as
# ``.mod``. Here the module is checkpointed in place (its parameter names stay), and its class
# becomes one named so, whose ``mod`` is the module itself: a subclass (as
# torch.nn.utils.parametrize swaps a module's class), one per class; a GraphModule has a class
# of its own already (fx makes one per instance, and its recompile does not allow subclasses),
# which is renamed instead.
_WRAPPERS: dict[tuple[type, bool], type] = {}


def _as_itself(self):
    """The checkpointed module itself (upstream's wrapper held it as ``mod``)."""
    return self


def _name_as_upstreams_wrapper(mod: torch.nn.Module) -> None:
    keep_mod = hasattr(mod, "mod")  # a module of its own named "mod" keeps that meaning
    cls = type(mod)
    if isinstance(mod, torch.fx.GraphModule):
        cls.__name__ = cls.__qualname__ = CHECKPOINT_CLASS
        if not keep_mod:
            cls.mod = property(_as_itself)
        return
    key = (cls, keep_mod)
    if key not in _WRAPPERS:
        body = {"__module__": cls.__module__,
                "__doc__": f"{cls.__name__}, checkpointed (upstream Slapo's wrapper's name)."}
        if not keep_mod:
            body["mod"] = property(_as_itself)
        _WRAPPERS[key] = type(CHECKPOINT_CLASS, (cls,), body)
    mod.__class__ = _WRAPPERS[key]


def checkpoint_call(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with its activations recomputed in the backward, as the
    primitive does (exported as ``slapo.checkpoint``, upstream Slapo's function form): random
    streams restored for the recomputation, a plain call without autograd, and, when ``fn``
    is a module, its batch norms' running statistics updated by the forward only::

        out = slapo.checkpoint(self.attention, hidden_states, attention_mask)
    """
    return _checkpointed(fn, fn if isinstance(fn, torch.nn.Module) else None, args, kwargs)


def _checkpointed(fn, module: torch.nn.Module | None, args: tuple, kwargs: dict):
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)

    def contexts():
        forward_ctx, recompute_ctx = rng_streams().checkpoint_contexts()
        if module is None:
            return forward_ctx, recompute_ctx
        return forward_ctx, _chain(recompute_ctx, _keep_running_stats(module))

    return torch_checkpoint(fn, *args, use_reentrant=False, context_fn=contexts, **kwargs)


@contextlib.contextmanager
def _chain(*contexts):
    with contextlib.ExitStack() as stack:
        for ctx in contexts:
            stack.enter_context(ctx)
        yield


@contextlib.contextmanager
def _keep_running_stats(module: torch.nn.Module):
    """Restore the running statistics of batch norms after the recomputation updated them."""
    norms = [m for m in module.modules()
             if isinstance(m, torch.nn.modules.batchnorm._NormBase) and m.track_running_stats]
    saved = [{k: b.clone() for k, b in m.named_buffers(recurse=False) if b is not None}
             for m in norms]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, buffers in zip(norms, saved):
                for key, value in buffers.items():
                    getattr(m, key).copy_(value)
