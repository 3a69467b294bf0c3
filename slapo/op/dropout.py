"""Dropout whose mask is drawn the way that is fast on the device it runs on.

On CUDA this is ``F.dropout`` (one fused Philox kernel). On CPU, PyTorch's dropout draws its
mask with ``bernoulli_``, which fills element by element: 512k elements (bert-tiny's attention
probabilities, batch 8, seq 128) took 3.8 ms forward + backward on 2 threads here, against
1.9 ms for a mask made from ``torch.rand`` (vectorised uniform draws, ``keep = u >= p``), and
dropout was 20% of bert-tiny's CPU training step. The mask has the same distribution, comes
from the same default generator (so ``fork_rng`` streams and ``checkpoint``'s replay of RNG
state control it as they control ``nn.Dropout``), but is not the same draw: masks differ from
``nn.Dropout``'s for the same seed. The CPU mask is kept in the input's dtype, scaled by
``1 / (1 - p)`` (4 bytes an element where ``F.dropout`` keeps 1): the faster of the two here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import state


def dropout_kernel(device_type: str) -> str:
    """The kernel ``dropout`` uses for tensors on ``device_type``."""
    return "uniform-mask" if device_type == "cpu" else "F.dropout"


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """``F.dropout(x, p, training)`` with the mask drawn as ``dropout_kernel`` says."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu" or p >= 1.0:
        return F.dropout(x, p, training=True)
    keep = (torch.rand_like(x) >= p).to(x.dtype).mul_(1.0 / (1.0 - p))
    return x * keep


@state.leaf_class  # traced as a call: its train/eval mode and rate are read when it runs
class Dropout(nn.Dropout):
    """``nn.Dropout`` computed by :func:`dropout` (same ``p``; ``inplace`` is ignored: the
    CPU kernel makes a new tensor, which autograd needs anyway)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training)


def use_device_dropout(sch) -> None:
    """Every ``nn.Dropout`` below ``sch`` becomes ``Dropout`` with the same ``p``: on
    CPU its mask comes from uniform draws instead of ``bernoulli_`` (twice as fast here), on
    CUDA it is ``F.dropout`` (``dropout``)."""
    for path, mod in list(sch.mod.named_modules()):
        if type(mod) is nn.Dropout:
            sch[path].replace(Dropout(mod.p))
