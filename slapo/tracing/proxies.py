"""Traced values that carry an example value.

While tracing with ``example_inputs``, each graph node keeps in ``node.meta[META]`` an example
of its value: a fake tensor, or a Python value such as a ``torch.Size``. The proxies here
answer ``len(x.shape)``, ``x.dim()`` and ``x.dtype`` from it, so that code branching on ranks
and dtypes traces, while the sizes themselves stay graph values. Kept apart from the tracer:
this module only reads example values; the tracer computes them (and decides ``if`` and
``for`` on traced values with them).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.fx.proxy import Attribute

from .errors import TraceError

META = "slapo_meta"         # node.meta key holding the example value while tracing
KIND = "slapo_kind"         # node.meta key kept after tracing: "tensor", "none", a type name
ITEMS = "slapo_items"       # ... and, for a tuple or list, the description of each item
UNKNOWN = object()          # no example value known for a node


class UnknownMeta(Exception):
    """Raised by ``to_meta`` for a value whose example is unknown."""


def meta_of(value: Any) -> Any:
    """The example value of a proxy (or UNKNOWN); non-proxies are their own example."""
    if isinstance(value, Attribute) and value._node is None:
        # An attribute not yet used is not a node yet: take the attribute of its root.
        root = meta_of(value.root)
        if root is UNKNOWN:
            return UNKNOWN
        try:
            return getattr(root, value.attr)
        except Exception:
            return UNKNOWN
    if isinstance(value, fx.Proxy):
        return value.node.meta.get(META, UNKNOWN)
    return value


def to_meta(value: Any) -> Any:
    """Like ``meta_of``, but raises UnknownMeta instead of returning UNKNOWN."""
    meta = meta_of(value)
    if meta is UNKNOWN:
        raise UnknownMeta
    return meta


def kind_of(meta: Any) -> str:
    """What ``node.meta[KIND]`` keeps of an example value once tracing is done."""
    if meta is UNKNOWN:
        return "unknown"
    if isinstance(meta, torch.Tensor):
        return "tensor"
    if meta is None:
        return "none"
    return type(meta).__name__


def items_of(meta: Any) -> tuple | None:
    """What ``node.meta[ITEMS]`` keeps of a tuple or list example value (None for others):
    each item's kind, or ``(kind, items)`` for an item that is itself a tuple or list. A
    ``torch.Size`` is one value, not a tuple of items."""
    if type(meta) not in (tuple, list):
        return None
    return tuple(kind_of(x) if items_of(x) is None else (kind_of(x), items_of(x))
                 for x in meta)


class MetaProxy(fx.Proxy):
    """A proxy that knows its example value: ``len``, iteration and ``bool`` use it, and the
    ``dtype`` and rank of a tensor are read from it (sizes stay graph values)."""

    def __getattr__(self, name: str):
        meta = meta_of(self)
        if meta is not UNKNOWN and not isinstance(meta, torch.Tensor):
            try:
                if getattr(meta, name) is None:
                    return None  # e.g. an unset field of a ModelOutput: None, not a graph value
            except Exception:
                pass
        return MetaAttribute(self, name)

    def __len__(self) -> int:
        meta = meta_of(self)
        try:
            return len(meta)
        except TypeError:
            raise TraceError(f"len() of the traced value '{self.node.name}' needs its example "
                             "value; pass example_inputs to trace") from None

    @property
    def dtype(self):
        meta = meta_of(self)
        if isinstance(meta, torch.Tensor):
            return meta.dtype
        return MetaAttribute(self, "dtype")

    @property
    def ndim(self):
        meta = meta_of(self)
        if isinstance(meta, torch.Tensor):
            return meta.dim()
        return MetaAttribute(self, "ndim")

    def dim(self):
        meta = meta_of(self)
        if isinstance(meta, torch.Tensor):
            return meta.dim()
        return self.tracer.create_proxy("call_method", "dim", (self,), {})


class MetaAttribute(Attribute, MetaProxy):
    """An attribute of a traced value (``x.shape``, ``x.device``), a node once it is used."""
