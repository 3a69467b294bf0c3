"""Call plans: which arguments of a module's forward are graph inputs and which are fixed.

A traced graph takes only some of the forward's arguments (the tensors); every other argument
is fixed to the value it had while tracing. A ``CallPlan`` records that split. The tracer
builds one per traced module (``plan_for_root`` for the module ``trace`` runs on,
``plan_for_call`` for a submodule traced where its parent calls it) and calls the original
forward through it; the call adapter keeps it to map later calls onto the graph inputs.
Kept apart from both because both depend on it and it depends on neither.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.fx.node import map_aggregate
from torch.utils import _pytree as pytree

from .proxies import UNKNOWN


@dataclass
class Slot:
    """One graph input: argument ``param`` (for ``**kwargs``: its entry ``key``; for
    ``*args``: its position ``key``)."""
    param: str
    key: str | int | None = None

    @property
    def name(self) -> str:
        if self.key is None:
            return self.param
        return f"{self.param}_{self.key}" if isinstance(self.key, int) else str(self.key)


@dataclass
class CallPlan:
    """How a traced module is called: the original signature, the graph inputs and the
    values the other arguments were fixed to while tracing."""
    signature: inspect.Signature            # without ``self``
    slots: list[Slot] = field(default_factory=list)
    slot_meta: list[Any] = field(default_factory=list)  # example value of each slot
    fixed: dict[str, Any] = field(default_factory=dict)  # param -> value (``**kw``: a dict)

    def arguments(self, inputs: Iterable[Any]) -> tuple[tuple, dict]:
        """The (args, kwargs) of a call of the original forward with these graph inputs.
        Arguments are passed by keyword where the signature allows it (decorators of HF
        forwards add keywords of their own); arguments neither fixed nor inputs are left out."""
        values: dict[str, Any] = {}
        for name, value in self.fixed.items():
            kind = self._kind(name)
            values[name] = dict(value) if kind == inspect.Parameter.VAR_KEYWORD else \
                tuple(value) if kind == inspect.Parameter.VAR_POSITIONAL else value
        for slot, value in zip(self.slots, inputs, strict=True):
            kind = self._kind(slot.param)
            if kind == inspect.Parameter.VAR_KEYWORD:
                values.setdefault(slot.param, {})[slot.key] = value
            elif kind == inspect.Parameter.VAR_POSITIONAL:
                items = list(values.get(slot.param, ()))
                items.insert(slot.key, value)
                values[slot.param] = tuple(items)
            else:
                values[slot.param] = value
        params = list(self.signature.parameters.values())
        # Once *args holds values, the parameters before it can only be passed by position.
        var_pos = any(p.kind == p.VAR_POSITIONAL and values.get(p.name) for p in params)
        args: list[Any] = []
        kwargs: dict[str, Any] = {}
        for p in params:
            positional = p.kind == p.POSITIONAL_ONLY or \
                (var_pos and p.kind == p.POSITIONAL_OR_KEYWORD)
            if p.name not in values:
                if positional:
                    args.append(p.default)
                continue
            value = values[p.name]
            if p.kind == p.VAR_POSITIONAL:
                args.extend(value)
            elif p.kind == p.VAR_KEYWORD:
                kwargs.update(value)
            elif positional:
                args.append(value)
            else:
                kwargs[p.name] = value
        return tuple(args), kwargs

    def _kind(self, param: str):
        return self.signature.parameters[param].kind


def plan_for_root(mod: nn.Module, example_inputs, concrete_args) -> CallPlan:
    """Graph inputs of a module traced on its own: the example inputs (or, without them,
    the arguments without defaults); all other arguments fixed."""
    sig = _forward_signature(mod)
    params = sig.parameters
    concrete = dict(concrete_args or {})
    var_kw = next((p.name for p in params.values() if p.kind == p.VAR_KEYWORD), None)
    for name in list(concrete):
        if name not in params and var_kw is None:
            if concrete[name] is None:  # fixing an absent optional argument to None: nothing
                del concrete[name]      # to fix (upstream's schedules list such arguments)
                continue
            raise TypeError(f"concrete_args names '{name}', which {type(mod).__name__}.forward "
                            f"does not take; its arguments: {', '.join(params)}")
    inputs: dict[str, Any] = {}
    if isinstance(example_inputs, dict):
        inputs = dict(example_inputs)
    elif example_inputs is not None:
        if isinstance(example_inputs, torch.Tensor):
            example_inputs = (example_inputs,)
        positional = [p.name for p in params.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(example_inputs) > len(positional):
            raise TypeError(f"{len(example_inputs)} example inputs for "
                            f"{type(mod).__name__}.forward, which takes {len(positional)} "
                            "positional arguments; pass a dict of named inputs")
        inputs = dict(zip(positional, example_inputs, strict=False))
    for name in inputs:
        if name not in params and var_kw is None:
            raise TypeError(f"example_inputs names '{name}', which {type(mod).__name__}.forward "
                            f"does not take; its arguments: {', '.join(params)}")
        if name in concrete:
            raise TypeError(f"argument '{name}' is both in example_inputs and concrete_args")

    plan = CallPlan(sig)
    for p in params.values():
        if p.kind == p.VAR_KEYWORD:
            extra = {k: v for k, v in {**inputs, **concrete}.items() if k not in params}
            fixed = {}
            for key, value in extra.items():
                if key in inputs and has_tensor(value):
                    plan.slots.append(Slot(p.name, key))
                    plan.slot_meta.append(value)
                else:
                    fixed[key] = value
            plan.fixed[p.name] = fixed
        elif p.kind == p.VAR_POSITIONAL:
            plan.fixed[p.name] = ()
        elif p.name in concrete:
            plan.fixed[p.name] = concrete[p.name]
        elif p.name in inputs:
            if has_tensor(inputs[p.name]):
                plan.slots.append(Slot(p.name))
                plan.slot_meta.append(inputs[p.name])
            else:
                plan.fixed[p.name] = inputs[p.name]
        elif example_inputs is None and p.default is p.empty:
            plan.slots.append(Slot(p.name))
            plan.slot_meta.append(UNKNOWN)
        elif p.default is not p.empty:
            continue  # left out of the call: the forward uses its default
        else:
            raise TypeError(f"argument '{p.name}' of {type(mod).__name__}.forward has no "
                            "default: give it in example_inputs or concrete_args")
    return plan


def plan_for_call(mod: nn.Module, args: tuple, kwargs: dict) -> CallPlan:
    """Graph inputs of a submodule traced where its parent calls it: the arguments that hold
    traced values; the others fixed to the values of this call."""
    sig = _forward_signature(mod)
    bound = sig.bind(*args, **kwargs)
    plan = CallPlan(sig)
    for name, value in bound.arguments.items():
        kind = sig.parameters[name].kind
        if kind == inspect.Parameter.VAR_KEYWORD:
            fixed = {}
            for key, item in value.items():
                if _contains_proxy(item):
                    plan.slots.append(Slot(name, key))
                    plan.slot_meta.append(item)
                else:
                    fixed[key] = item
            plan.fixed[name] = fixed
        elif kind == inspect.Parameter.VAR_POSITIONAL:
            if _contains_proxy(value):
                for i, item in enumerate(value):
                    plan.slots.append(Slot(name, i))
                    plan.slot_meta.append(item)
                plan.fixed[name] = ()
            else:
                plan.fixed[name] = value
        elif _contains_proxy(value):
            plan.slots.append(Slot(name))
            plan.slot_meta.append(value)
        else:
            plan.fixed[name] = value
    return plan


def has_tensor(value: Any) -> bool:
    """Whether ``value`` is or holds (in a tuple, list or dict) a tensor."""
    return any(isinstance(v, torch.Tensor) for v in pytree.tree_leaves(value))


def _forward_signature(mod: nn.Module) -> inspect.Signature:
    """The signature of ``mod``'s forward without ``self`` (through decorators' wrappers)."""
    sig = inspect.signature(type(mod).forward)
    return sig.replace(parameters=list(sig.parameters.values())[1:])


def _contains_proxy(value: Any) -> bool:
    found = []
    map_aggregate(value, lambda v: found.append(v) if isinstance(v, fx.Proxy) else None)
    return bool(found)
