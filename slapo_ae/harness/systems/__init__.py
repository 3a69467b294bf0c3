"""The systems the harness runs a case under, one module each, selected by the case's mode.

| mode              | module             | what trains                                         |
|-------------------|--------------------|-----------------------------------------------------|
| megatron          | megatron.py        | megatron-core's own model, TP = ranks               |
| slapo-megatron    | slapo_tp.py        | HF model + Slapo schedule, TP = ranks (Slapo-TP)    |
| deepspeed         | deepspeed_zero3.py | HF model on DeepSpeed ZeRO-3                        |
| slapo-deepspeed   | slapo_zero3.py     | HF model + Slapo schedule on ZeRO-3 (Slapo-ZeRO3)   |
| eager             | eager.py           | HF model as is, data parallel (Figure 9: Vanilla)   |
| hf-sdpa           | eager.py           | HF model with HF's SDPA attention, data parallel    |
| hf-compile        | eager.py           | HF model (SDPA) under torch.compile, data parallel  |
| hf-liger          | eager.py           | HF model (SDPA) with liger-kernel's kernels (GPU)   |
| slapo-kernel      | slapo_tp.py        | + Kernel Opt (no TP)                                |
| slapo-tp-attn-ffn | slapo_tp.py        | + Attn/FFN TP (embedding whole)                     |
| slapo-tp-full     | slapo_tp.py        | + Embedding TP                                      |
| torchscript       | (none)             | always ``unsupported`` (``support.check``)          |

A ``megatron`` or ``slapo-megatron`` case with pipeline stages or data-parallel replicas
(``Case.is_3d``: ``pp`` > 1, or ``tp`` below the GPUs) runs under the mode's 3D system:
``megatron_3d.py`` (megatron-core's pipeline schedule and parallel state) and ``slapo_3d.py``
(Slapo's pipeline stages on DeepSpeed's pipeline engine over a ``slapo.Topology``, as the
paper's Slapo ran them).

The protocol is in :mod:`.base`; which cases a system can run is decided by
:func:`.support.check`, without importing torch. Modules are imported lazily: choosing
``eager`` never imports DeepSpeed or megatron-core.
"""
from __future__ import annotations

import importlib

from .support import Unsupported, check

_MODULES = {
    "megatron": ("megatron", "MegatronSystem"),
    "slapo-megatron": ("slapo_tp", "SlapoTPSystem"),
    "slapo-tp-full": ("slapo_tp", "SlapoTPFullSystem"),
    "slapo-tp-attn-ffn": ("slapo_tp", "SlapoTPAttnFFNSystem"),
    "slapo-kernel": ("slapo_tp", "SlapoKernelSystem"),
    "deepspeed": ("deepspeed_zero3", "DeepSpeedZero3System"),
    "slapo-deepspeed": ("slapo_zero3", "SlapoZero3System"),
    "eager": ("eager", "EagerSystem"),
    "hf-sdpa": ("eager", "HFSdpaSystem"),
    "hf-compile": ("eager", "HFCompileSystem"),
    "hf-liger": ("eager", "HFLigerSystem"),
}


# The 3D systems of the modes that take pp/tp/micro (Case.is_3d)
_MODULES_3D = {
    "megatron": ("megatron_3d", "Megatron3DSystem"),
    "slapo-megatron": ("slapo_3d", "Slapo3DSystem"),
}


def get_system(mode: str, is_3d: bool = False):
    """The system class of ``mode`` (a :class:`.base.System`; its 3D system for a case with
    ``is_3d``, see above); ``KeyError`` for an unknown mode and for ``torchscript``, which
    :func:`check` refuses."""
    if is_3d and mode in _MODULES_3D:
        module, name = _MODULES_3D[mode]
        return getattr(importlib.import_module(f"{__name__}.{module}"), name)
    if mode not in _MODULES:
        known = ", ".join(list(_MODULES) + ["torchscript"])
        raise KeyError(f"unknown mode {mode!r}; known: {known}")
    module, name = _MODULES[mode]
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def modes() -> list[str]:
    return list(_MODULES) + ["torchscript"]


__all__ = ["Unsupported", "check", "get_system", "modes"]
