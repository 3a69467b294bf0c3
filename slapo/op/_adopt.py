"""Building a kernel module around another module's parameters."""

from __future__ import annotations

from torch import nn


def adopt(cls: type, source: nn.Module, fields: tuple[str, ...], **extra) -> nn.Module:
    """An instance of ``cls`` holding ``source``'s ``fields`` (its parameters: the same
    objects, so shards, ties and annotations stay) and ``extra``; ``cls.__init__`` is not run,
    since it would allocate and draw fresh weights."""
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    for name in fields:
        setattr(new, name, getattr(source, name))
    for name, value in extra.items():
        setattr(new, name, value)
    return new
