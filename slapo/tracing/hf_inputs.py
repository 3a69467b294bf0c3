"""Example inputs made from a transformers config, for ``trace`` of a transformers module.

Upstream Slapo's "huggingface" tracer (transformers' fx tracer) made dummy inputs itself, from
the argument names. Ours traces HF blocks when it knows example shapes, so ``trace`` of a
module of a transformers model makes example inputs for the usual argument names from the
model's config, whatever tracer is named: each argument of
``forward`` that ``concrete_args`` does not fix becomes an input if it has no default and a
name below (``_MAKERS``), or if it is one of the main inputs (``_MAIN``) even with a default;
any other argument keeps its default (one without a default is an error that names it).
Optional inputs that change what a module computes (``labels``, ``encoder_hidden_states``)
are made only when they are required.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

# Small and fixed: the graph keeps sizes as graph values, so other shapes run later.
BATCH, SEQ = 2, 8


def _ids(config, model: bool) -> torch.Tensor:
    vocab = getattr(config, "vocab_size", None) or SEQ
    return (torch.arange(BATCH * SEQ) % vocab).view(BATCH, SEQ)


def _mask(config, model: bool) -> torch.Tensor:
    # A model takes the 0/1 padding mask; its blocks take the additive 4-d mask it makes.
    if model:
        return torch.ones(BATCH, SEQ, dtype=torch.long)
    return torch.zeros(BATCH, 1, SEQ, SEQ)


def _hidden(config, model: bool) -> torch.Tensor:
    return torch.randn(BATCH, SEQ, config.hidden_size)


_MAKERS: dict[str, Callable[[Any, bool], torch.Tensor]] = {
    "input_ids": _ids,
    "labels": _ids,
    "decoder_input_ids": _ids,
    "attention_mask": _mask,
    "decoder_attention_mask": _mask,
    "token_type_ids": lambda config, model: torch.zeros(BATCH, SEQ, dtype=torch.long),
    "position_ids": lambda config, model: torch.arange(SEQ).expand(BATCH, SEQ),
    "hidden_states": _hidden,
    "encoder_hidden_states": _hidden,
}
# Made even where the argument has a default: what a model or block is called with.
_MAIN = ("input_ids", "attention_mask", "token_type_ids", "position_ids", "hidden_states")


def example_inputs_from_config(mod: nn.Module, config, concrete_args: dict | None,
                               where: str) -> dict[str, torch.Tensor]:
    """Example inputs of ``mod`` made from the transformers ``config`` (see the module)."""
    if config is None:
        raise ValueError(f"trace(tracer='huggingface') of '{where}' ({type(mod).__name__}) "
                         "makes example inputs from the model config: pass config= (or "
                         "example_inputs=)")
    if not hasattr(config, "hidden_size"):
        raise TypeError(f"trace(config=...) of '{where}' expects a transformers config (with "
                        f"hidden_size), got {type(config).__name__}")
    from transformers import PreTrainedModel  # only this path needs transformers

    model = isinstance(mod, PreTrainedModel)
    fixed = concrete_args or {}
    inputs = {}
    for name, p in inspect.signature(mod.forward).parameters.items():
        if name in fixed or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if name in _MAKERS and (p.default is p.empty or name in _MAIN):
            inputs[name] = _MAKERS[name](config, model)
        elif p.default is p.empty:
            raise ValueError(f"trace(tracer='huggingface') of '{where}' "
                             f"({type(mod).__name__}) cannot make an example for the argument "
                             f"'{name}' (it makes {', '.join(_MAKERS)}); pass example_inputs= "
                             "or fix it with concrete_args=")
    return inputs


def named_example_inputs(mod: nn.Module, config, names) -> dict[str, torch.Tensor]:
    """Example values for the arguments ``names`` of ``mod``'s forward (each one that
    ``_MAKERS`` makes), in the forward's order, defaults or not: what a pipeline's first
    stage takes (T5's decoder inputs have defaults)."""
    from transformers import PreTrainedModel

    model = isinstance(mod, PreTrainedModel)
    return {name: _MAKERS[name](config, model)
            for name in inspect.signature(mod.forward).parameters if name in names}
