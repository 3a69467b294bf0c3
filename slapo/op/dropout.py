"""Dropout whose mask is drawn the way that is fast on the device it runs on.

On CUDA this is ``F.dropout`` (one fused Philox kernel). On CPU, PyTorch's dropout draws its
mask with ``bernoulli_``, one generator call per element, and dropout was 20% of bert-tiny's
CPU training step. Here the CPU mask comes from 16-bit draws, four to each 64-bit draw of the
default generator (``random_`` over the whole int64 range, viewed as int16): an element is kept
when its draw is at least ``p`` of the way up the 16-bit range. Forward + backward on 262k
elements, one thread (2026-12-02): 1.0 to 1.5 ms, against 2.5 to 2.9 ms for a mask from
``torch.rand`` (``u >= p``, this kernel before) and 3.5 ms for ``F.dropout``. On t5-tiny, whose
HF model draws half again as many dropout elements as megatron-core's T5, that was the gap in
compute between Slapo-TP and Megatron-LM (docs/workflow.md).

Inside a compiled region (the CUDA choices' compiled layers, run on CPU by the tests) it is
``F.dropout`` on CPU too: ``random_`` would break the region's graph at every dropout, so the
CPU stand-in of a GPU region would compile other graphs than the GPU does; Inductor draws
``F.dropout``'s mask in the region with its own generator, as on CUDA.

The rate is rounded to a multiple of 2**-16 (0.1 becomes 0.100006) and what is kept is scaled
by the rounded rate, so the output is unbiased; a rate that rounds to 0 or 1 takes
``F.dropout``. The mask comes from the same default generator as ``nn.Dropout``'s (so
``fork_rng`` streams and ``checkpoint``'s replay of RNG state control it the same way) but is
not the same draw. It is kept in the input's dtype, already scaled (4 bytes an element where
``F.dropout`` keeps 1): the faster of the two here.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .. import state

# The CPU mask's draws: 16-bit lanes of 64-bit words.
_LEVELS = 2**16
_LANES = 4


def dropout_kernel(device_type: str) -> str:
    """The kernel ``dropout`` uses for tensors on ``device_type``."""
    return "16-bit-mask" if device_type == "cpu" else "F.dropout"


def keep_mask(shape, rate_levels: int) -> torch.Tensor:
    """Boolean CPU mask of ``shape``, each element False with probability
    ``rate_levels / 2**16``: a 16-bit lane of the default generator's 64-bit draws per
    element. ``random_`` must span all of int64 (its default stops at 2**63 - 1, which would
    leave every fourth lane's sign bit clear)."""
    numel = math.prod(shape)
    words = torch.empty(-(-numel // _LANES), dtype=torch.int64).random_(-2**63, None)
    draws = words.view(torch.int16)[:numel].view(shape)
    return draws >= rate_levels - _LEVELS // 2


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """``F.dropout(x, p, training)`` with the mask drawn as ``dropout_kernel`` says (and as
    ``F.dropout`` in a compiled region: the module docstring)."""
    if not training or p == 0.0:
        return x
    levels = round(p * _LEVELS)
    if x.device.type != "cpu" or not 0 < levels < _LEVELS or torch.compiler.is_compiling():
        return F.dropout(x, p, training=True)
    keep = keep_mask(x.shape, levels).to(x.dtype).mul_(_LEVELS / (_LEVELS - levels))
    return x * keep


@state.leaf_class  # traced as a call: its train/eval mode and rate are read when it runs
class Dropout(nn.Dropout):
    """``nn.Dropout`` computed by :func:`dropout` (same ``p``; ``inplace`` is ignored: the
    CPU kernel makes a new tensor, which autograd needs anyway)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training)


def use_device_dropout(sch) -> None:
    """Every ``nn.Dropout`` below ``sch`` becomes ``Dropout`` with the same ``p``: on
    CPU its mask comes from 16-bit draws instead of ``bernoulli_`` (three times as fast here), on
    CUDA it is ``F.dropout`` (``dropout``)."""
    for path, mod in list(sch.mod.named_modules()):
        if type(mod) is nn.Dropout:
            sch[path].replace(Dropout(mod.p))
