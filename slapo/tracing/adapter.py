"""The call adapter: what lets a traced module still be called like the original one.

A traced GraphModule takes only its graph inputs. ``trace_module`` registers a
``CallAdapter`` as its forward pre-hook: it accepts the original forward's signature, passes
the graph inputs on, and raises a clear error when an argument that tracing fixed arrives
with another value. It runs on every later call, long after tracing, which is why it is
apart from the tracer; the tracer reads it too, to call an already traced submodule and to
tell slapo's own hook from hooks that primitives or users added.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from .call_plan import CallPlan, has_tensor
from .errors import TraceError
from .proxies import UNKNOWN

# Values compared by equality with the traced value; for others only None-ness must match.
_SIMPLE = (bool, int, float, str, torch.dtype, type(None))


class CallAdapter:
    """Forward pre-hook of a traced module: accepts the original signature, returns the graph
    inputs, and checks that fixed arguments have the values they were traced with."""

    def __init__(self, plan: CallPlan, where: str, training: bool = True):
        self.training = training
        self.warned = False
        self.signature = plan.signature
        self.slots = plan.slots
        self.slot_is_tensor = [has_tensor(m) if m is not UNKNOWN else None
                               for m in plan.slot_meta]
        self.fixed = plan.fixed
        self.where = where
        # each tensor input's example dimensions and dtype, and the functions that make a
        # tensor input the caller left None (of a transformers block: its masks; see
        # hf_inputs.skipped_mask_makers), set by whoever traced it
        self.tensor_inputs = {slot.name: (meta.dim(), meta.dtype)
                              for slot, meta in zip(plan.slots, plan.slot_meta, strict=True)
                              if isinstance(meta, torch.Tensor)}
        self.none_makers: dict[str, Callable[[dict], torch.Tensor | None]] = {}

    def map_call(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The graph inputs of a call with the original signature (as the hook's (args,
        kwargs)), after checking the fixed arguments."""
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as err:
            raise TypeError(f"traced '{self.where}': {err}") from None
        values = bound.arguments
        inputs = []
        for slot, is_tensor in zip(self.slots, self.slot_is_tensor, strict=True):
            kind = self.signature.parameters[slot.param].kind
            if kind == inspect.Parameter.VAR_KEYWORD:
                value = values.get(slot.param, {}).get(slot.key)
            elif kind == inspect.Parameter.VAR_POSITIONAL:
                items = values.get(slot.param, ())
                value = items[slot.key] if slot.key < len(items) else None
            elif slot.param in values:
                value = values[slot.param]
            else:
                value = self.signature.parameters[slot.param].default
                value = None if value is inspect.Parameter.empty else value
            if is_tensor and value is None:
                value = self._made_for_none(slot.name, values)
            inputs.append(value)
        slot_params = {s.param for s in self.slots}
        for name, value in values.items():  # only what the caller passed explicitly
            param = self.signature.parameters[name]
            if param.kind == inspect.Parameter.VAR_KEYWORD:
                traced = self.fixed.get(name, {})
                taken = {s.key for s in self.slots if s.param == name}
                for key, item in value.items():
                    if key not in taken:
                        self._check(key, traced.get(key), item)
            elif param.kind == inspect.Parameter.VAR_POSITIONAL:
                if value and name not in slot_params:
                    raise ValueError(f"traced '{self.where}' was traced without extra "
                                     f"positional arguments; got {len(value)}")
            elif name not in slot_params:
                self._check(name, self.fixed.get(name, param.default), value)
        return tuple(inputs), {}

    def _made_for_none(self, name: str, values: dict) -> torch.Tensor:
        make = self.none_makers.get(name)
        value = make(values) if make is not None else None
        if value is None:
            raise ValueError(f"traced '{self.where}' takes a tensor for '{name}' (a graph "
                             "input) but was called with None; trace it again without that "
                             "input")
        return value

    def _check(self, name: str, traced: Any, value: Any) -> None:
        if traced is value:
            return
        if isinstance(value, fx.Proxy):
            raise TraceError(f"traced '{self.where}' has argument '{name}' fixed to "
                             f"{_short(traced)}; it cannot take a traced value now")
        if isinstance(traced, _SIMPLE) and isinstance(value, _SIMPLE):
            same = type(traced) is type(value) and traced == value
        else:
            same = (traced is None) == (value is None)
        if not same:
            raise ValueError(
                f"traced '{self.where}' has argument '{name}' fixed to {_short(traced)}; it "
                f"was called with {_short(value)}. Trace again with that value (concrete_args) "
                "or make it a graph input (example_inputs)")

    def __call__(self, module, args, kwargs):
        if module.training != self.training and not self.warned:
            self.warned = True
            warnings.warn(f"traced '{self.where}' was traced in {_mode(self.training)} mode and "
                          f"now runs in {_mode(module.training)} mode: code paths fixed while "
                          "tracing (such as the dropout rate HF attention passes on) keep the "
                          "traced mode; trace again in the mode you run", stacklevel=2)
        return self.map_call(args, kwargs)


def adapter_of(mod: nn.Module) -> CallAdapter | None:
    """The call adapter of a traced module (None if ``mod`` was not traced)."""
    return next((h for h in mod._forward_pre_hooks.values() if isinstance(h, CallAdapter)),
                None)


def _mode(training: bool) -> str:
    return "train" if training else "eval"


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return text if len(text) < 60 else text[:57] + "..."
