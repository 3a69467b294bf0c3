"""Example inputs made from a transformers config, for ``trace`` of a transformers module.

Upstream Slapo's "huggingface" tracer (transformers' fx tracer) made dummy inputs itself, from
the argument names. Ours traces HF blocks when it knows example shapes, so ``trace`` of a
module of a transformers model makes example inputs for the usual argument names from the
model's config, whatever tracer is named: each argument of
``forward`` that ``concrete_args`` does not fix becomes an input if it has no default and a
name below (``_MAKERS``), or if it is one of the main inputs (``_MAIN``) even with a default;
any other argument keeps its default (one without a default is an error that names it).
A block's ``position_embeddings`` (the rotary (cos, sin) that models of LLaMA's kind pass
every block) are made only for a config with ``rope_parameters``.
Optional inputs that change what a module computes (``labels``, ``encoder_hidden_states``)
are made only when they are required.

It also gives the masks transformers leaves out (``skipped_mask_makers``): a traced block
takes its attention mask as a graph input, and transformers 5 passes None where a mask
would change nothing.
"""

from __future__ import annotations

import functools
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


def _rotary(config, model: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    # The (cos, sin) of rotary embeddings, which the models of transformers 5 with a rotary
    # config (LLaMA's kind) compute once and pass to every block, one head's width each.
    if not hasattr(config, "rope_parameters"):
        return None
    width = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return torch.randn(BATCH, SEQ, width), torch.randn(BATCH, SEQ, width)


_MAKERS: dict[str, Callable[[Any, bool], Any]] = {
    "input_ids": _ids,
    "labels": _ids,
    "decoder_input_ids": _ids,
    "attention_mask": _mask,
    "decoder_attention_mask": _mask,
    "token_type_ids": lambda config, model: torch.zeros(BATCH, SEQ, dtype=torch.long),
    "position_ids": lambda config, model: torch.arange(SEQ).expand(BATCH, SEQ),
    "hidden_states": _hidden,
    "encoder_hidden_states": _hidden,
    "position_embeddings": _rotary,
}
# Made even where the argument has a default: what a model or block is called with.
_MAIN = ("input_ids", "attention_mask", "token_type_ids", "position_ids", "hidden_states",
         "position_embeddings")


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
        wanted = name in _MAKERS and (p.default is p.empty or name in _MAIN)
        example = _MAKERS[name](config, model) if wanted else None
        if example is not None:
            inputs[name] = example
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


# --- the masks transformers 5 leaves out -----------------------------------------------------
# A model of transformers 5 gives its blocks no attention mask (None) where one would mask
# nothing: for an unpadded batch under bidirectional attention, and, under SDPA, for an
# unpadded causal one, which SDPA then makes causal itself (``is_causal``: its attention
# module's ``is_causal``). A block traced with a mask takes it as a graph input, and its graph
# cannot take None; such a call gets the mask the model left out instead: one that masks
# nothing (broadcast over every dimension), or, for a block whose attention is causal and not
# transformers' eager one (which reads None as no mask, and always gets the causal mask from
# the model), the causal mask of its ``hidden_states``' length. The mask keeps the traced
# one's kind (additive floats in ``hidden_states``' dtype, as transformers makes them, or
# booleans, True where a query attends).
MASK_ARGUMENTS = ("attention_mask", "encoder_attention_mask")


def skipped_mask_makers(mod: nn.Module, inputs: dict[str, tuple[int, torch.dtype]]
                        ) -> dict[str, Callable]:
    """For each 4-d mask argument of ``mod`` (a block of a transformers model, before tracing)
    among its tensor graph ``inputs`` (name: the traced example's dimensions and dtype), the
    function that makes the mask the model leaves out from the call's bound arguments (None
    where it cannot)."""
    causal = any(getattr(m, "is_causal", False) is True and _reads_none_as_causal(m)
                 for m in mod.modules())
    makers = {}
    for name, (dims, dtype) in inputs.items():
        if name in MASK_ARGUMENTS and dims == 4 and \
                (dtype == torch.bool or dtype.is_floating_point):
            makers[name] = functools.partial(_skipped_mask, boolean=dtype == torch.bool,
                                             dtype=dtype,
                                             causal=causal and name == "attention_mask")
    return makers


def _reads_none_as_causal(attention: nn.Module) -> bool:
    # transformers' own (eager) attention reads None as no mask at all, and transformers
    # always gives it a causal mask; every other (SDPA, flash, flex) as causal, is_causal
    implementation = getattr(getattr(attention, "config", None), "_attn_implementation", None)
    return implementation != "eager"


def _skipped_mask(arguments: dict[str, Any], *, boolean: bool, dtype: torch.dtype,
                  causal: bool) -> torch.Tensor | None:
    hidden = arguments.get("hidden_states")
    hidden = hidden if isinstance(hidden, torch.Tensor) else None
    device = hidden.device if hidden is not None else None
    if not boolean and hidden is not None and hidden.is_floating_point():
        dtype = hidden.dtype
    if not causal:
        return torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device) if boolean else \
            torch.zeros((1, 1, 1, 1), dtype=dtype, device=device)
    cached = any(arguments.get(key) is not None
                 for key in ("cache", "past_key_values", "past_key_value"))
    if hidden is None or hidden.dim() < 2 or cached:
        return None  # the lengths of the queries and keys are not known
    length = hidden.shape[-2]
    attend = torch.ones((length, length), dtype=torch.bool, device=device).tril()
    if not boolean:
        attend = torch.zeros((length, length), dtype=dtype, device=device).masked_fill(
            ~attend, torch.finfo(dtype).min)
    return attend[None, None]
