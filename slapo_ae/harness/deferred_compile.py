"""``torch.compile`` on plain functions deferred to their first call, in the ranks.

megatron-core and DeepSpeed decorate dozens of functions with ``torch.compile`` when they are
imported (``megatron.core.jit.jit_fuser``, ``deepspeed.runtime.zero.muon``). Building those
wrappers imports TorchDynamo and Inductor: about 3 s of every rank's set-up on this CPU,
though a CPU run calls none of them. ``torch.compile`` itself compiles only on the first call,
so building the wrapper at that call instead changes when the import is paid, not what runs:
a function that is called is compiled exactly as before (same arguments, same backend).

Modules, methods and anything else that is not a plain function go to ``torch.compile`` at once
(an ``OptimizedModule`` must exist before its attributes are read). The record's ``env``
says how many functions were deferred and which of them were compiled (:func:`summary`).
"""
from __future__ import annotations

import functools
import types

_real_compile = None
_deferred: list[str] = []   # qualified names of the functions wrapped
_compiled: list[str] = []   # those compiled since, at their first call


def _name(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _deferring_compile(model=None, **options):
    if model is None:  # @torch.compile(...) with options: a decorator
        return lambda fn: _deferring_compile(fn, **options)
    if not isinstance(model, types.FunctionType):
        return _real_compile(model, **options)
    compiled = None

    @functools.wraps(model)
    def call(*args, **kwargs):
        nonlocal compiled
        if compiled is None:
            compiled = _real_compile(model, **options)
            _compiled.append(_name(model))
        return compiled(*args, **kwargs)

    _deferred.append(_name(model))
    return call


def install() -> None:
    """Replace ``torch.compile`` in this process (once; a rank is one process per case)."""
    global _real_compile
    import torch

    if _real_compile is None:
        _real_compile = torch.compile
        torch.compile = _deferring_compile


def summary() -> dict:
    """How many functions were deferred, and which were compiled at a first call."""
    return {"deferred": len(_deferred), "compiled": sorted(set(_compiled))}
