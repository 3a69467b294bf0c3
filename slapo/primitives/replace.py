"""replace: swap a module for another module or a function."""

from __future__ import annotations

from typing import Callable

from torch import nn

from . import register_primitive
from ._params import annotations


class FunctionModule(nn.Module):
    """Wraps a plain function so that it can stand where a module stood."""

    def __init__(self, fn: Callable):
        super().__init__()
        self.fn = fn

    def forward(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def extra_repr(self) -> str:
        return getattr(self.fn, "__qualname__", repr(self.fn))


@register_primitive()
def replace(sch, new: nn.Module | Callable) -> None:
    """Replace this node's module with ``new`` (a module, or a function wrapped in one).

    The schedule tree is updated in place: this node now schedules ``new`` and its children
    are ``new``'s children, ready to be scheduled further. Annotations of parameters carry
    over to the parameters of ``new`` that have the same name.

    Example::

        sch["encoder.layer.0.attention.self"].replace(MyFusedAttention(config))
    """
    if not isinstance(new, nn.Module):
        if not callable(new):
            raise TypeError(f"replace expects a module or a callable, got {type(new).__name__}")
        new = FunctionModule(new)
    old_params = dict(sch.mod.named_parameters())
    for name, param in new.named_parameters():
        old = old_params.get(name)
        if old is not None and old is not param and getattr(old, "slapo_annotations", None):
            annotations(param).update(old.slapo_annotations)
    if sch.parent is not None:
        setattr(sch.parent.mod, sch.name, new)
    sch.mod = new
    sch._rebuild_children()
