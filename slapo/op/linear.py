"""The vocabulary projection with its matrix products on aligned shapes.

A language model's output projection has as many output features as words, and the paper's
vocabularies are odd sizes: BERT's 30522, RoBERTa's 50265, GPT-Neo's and GPT-2's 50257. The
logits ``[tokens, vocabulary]`` and their gradient then have rows whose length is no multiple
of 8 bf16 elements (16 bytes), which cuBLAS's fast tensor-core kernels need: on one H200
(torch 2.11+cu130; ``results/reference/h200/2026-12-04/extra``) bert-large's three vocabulary
products ran on CUTLASS sm80 kernels at 3.8 to 4.1 ms each a step (250 to 270 TFLOP/s, 12 of
hf-sdpa's 119 ms of kernel time), where its other products ran on Hopper (nvjet) kernels;
llama-1.1b, whose 32000 words are a multiple of 128, had none of them. Megatron-LM pads the
vocabulary for the same reason (``--make-vocab-size-divisible-by``, 128) and ``torch.compile``
pads such products itself (Inductor's ``shape_padding``), so ``hf-compile`` most likely does not
pay for it (not yet profiled).

Here the parameters keep their shape (state dicts, tied weights and shards are untouched):
each call pads the weight (and bias) with zero rows to a multiple of ``VOCAB_MULTIPLE``,
multiplies on the padded shape and returns the view of the real columns. The zero rows add
nothing to the result or to any gradient; what it costs is a copy of the weight and one of
the logits' gradient (its padded layout), a small fraction of the products' time. Where
the loss is ``compiled_cross_entropy``, the second copy is left out: that loss reads the padded
product and writes the padded gradient in its own backward. It pads
for tensors on CUDA only (``PADDED_ON``): on CPU the BLAS has no such cliff and the copies
would be pure cost.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._adopt import adopt

VOCAB_MULTIPLE = 128  # Megatron-LM's default --make-vocab-size-divisible-by
PADDED_ON = ("cuda",)


def padded_rows(rows: int, multiple: int) -> int:
    """How many zero rows bring ``rows`` up to a multiple of ``multiple``."""
    return -rows % multiple


def padded_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  multiple: int = VOCAB_MULTIPLE) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed with ``weight``'s rows (the output features)
    padded to a multiple of ``multiple``; the result is the view of the real features (its
    rows' stride is the padded width). Under autocast the weight and bias are cast to its
    dtype before they are padded, as ``F.linear`` would cast them: padding an fp32 weight
    first wrote a padded fp32 copy for autocast to cast again (GPT-Neo's head: 412 MB a
    call)."""
    rows = weight.shape[0]
    pad = padded_rows(rows, multiple)
    if pad == 0:
        return F.linear(x, weight, bias)
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        weight = weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    weight = F.pad(weight, (0, 0, 0, pad))
    if bias is not None:
        bias = F.pad(bias, (0, pad))
    return F.linear(x, weight, bias)[..., :rows]


def vocab_projection_kernel(device_type: str) -> str:
    """What :class:`PaddedLinear` does for tensors on ``device_type`` (for records)."""
    if device_type in PADDED_ON:
        return (f"output features padded to a multiple of {VOCAB_MULTIPLE} in the matmul "
                "(aligned cuBLAS kernels; the parameters keep their shape)")
    return "unpadded"


class PaddedLinear(nn.Linear):
    """An ``nn.Linear`` (the same parameter objects) computed by :func:`padded_linear` for
    inputs on a device in ``pad_on``, by ``F.linear`` elsewhere. Under tensor parallelism
    the shard's rows are padded, and a sharded one overlaps its weight gradient as a plain
    Linear does (``slapo.sharding.overlap`` asks :meth:`padding`)."""

    multiple: int = VOCAB_MULTIPLE
    pad_on: tuple[str, ...] = PADDED_ON

    @classmethod
    def from_linear(cls, linear: nn.Linear, multiple: int = VOCAB_MULTIPLE,
                    pad_on: tuple[str, ...] = PADDED_ON) -> PaddedLinear:
        if multiple < 1:
            raise ValueError(f"PaddedLinear: multiple must be at least 1, got {multiple}")
        return adopt(cls, linear, ("in_features", "out_features", "weight", "bias"),
                     multiple=multiple, pad_on=tuple(pad_on))

    def padding(self, x: torch.Tensor) -> int:
        """The zero rows this call pads the weight with (0: a plain ``F.linear``)."""
        if x.device.type not in self.pad_on:
            return 0
        return padded_rows(self.weight.shape[0], self.multiple)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type not in self.pad_on:
            return F.linear(x, self.weight, self.bias)
        return padded_linear(x, self.weight, self.bias, self.multiple)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, padded to a multiple of {self.multiple} on {self.pad_on}"


def output_embedding(model: nn.Module) -> nn.Module | None:
    """``model``'s LM head (transformers' ``get_output_embeddings()``), None without one."""
    get_head = getattr(model, "get_output_embeddings", None)
    return get_head() if callable(get_head) else None


def use_padded_vocab(sch, multiple: int = VOCAB_MULTIPLE) -> str | None:
    """Compute the output projection of the model under ``sch`` (transformers'
    ``get_output_embeddings()``, an ``nn.Linear``) with :class:`PaddedLinear`; returns its
    path, or None for a model without one. A tied weight stays tied: the new module holds the
    same parameters."""
    head = output_embedding(sch.mod)
    if not isinstance(head, nn.Linear) or isinstance(head, PaddedLinear):
        return None
    path = next(path for path, mod in sch.mod.named_modules() if mod is head)
    sch[path].replace(PaddedLinear.from_linear(head, multiple))
    return path
