"""build: turn a schedule into the module to train."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def build(sch, init_weights: Callable[[nn.Module], None] | None = None) -> nn.Module:
    """Return the scheduled model, ready for an optimizer.

    Primitives take effect as they are applied, so ``build`` only finishes the model:
    ``init_weights(module)``, when given, is called on every submodule (under ``no_grad``) to
    initialise parameters after sharding, for example on a model created on the meta device
    and materialised with ``to_empty``. Parameters still on the meta device are an error.
    """
    model = sch.mod
    if init_weights is not None:
        with torch.no_grad():
            model.apply(init_weights)
    meta = [name for name, p in model.named_parameters() if p.is_meta]
    if meta:
        raise ValueError(f"parameters still on the meta device after build: {', '.join(meta[:5])}"
                         f"{' ...' if len(meta) > 5 else ''}; materialise them (to_empty) and pass "
                         "init_weights")
    return model
