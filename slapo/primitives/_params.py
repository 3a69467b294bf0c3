"""Looking parameters up on a schedule node, with errors that name the module."""

from __future__ import annotations

import torch
from torch import nn


def get_param(sch, name: str) -> nn.Parameter:
    """The parameter ``name`` registered directly on ``sch.mod``."""
    param = sch.mod._parameters.get(name)
    if param is None:
        own = ", ".join(n for n, p in sch.mod._parameters.items() if p is not None) or "none"
        where = sch.path or "<root>"
        raise ValueError(f"module '{where}' ({type(sch.mod).__name__}) has no parameter "
                         f"'{name}'; its own parameters: {own}")
    return param


def annotations(param: nn.Parameter) -> dict:
    """The annotation dictionary of a parameter (created empty on first use)."""
    if not hasattr(param, "slapo_annotations"):
        param.slapo_annotations = {}
    return param.slapo_annotations


def set_annotation(param: nn.Parameter, key: str, value, where: str = "") -> None:
    """``key = value`` in the parameter's annotations, and as an attribute of the parameter
    (``param.<key>``, where upstream Slapo put it), unless the name is a tensor's own."""
    if key == "slapo_annotations" or hasattr(torch.Tensor, key):
        raise ValueError(f"annotation {key!r}{f' on {where}' if where else ''} would hide the "
                         "tensor attribute of that name; choose another key")
    annotations(param)[key] = value
    setattr(param, key, value)
