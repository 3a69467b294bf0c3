"""The primitive registry: each primitive is a function ``f(sch, ...)`` registered by name.

``slapo.list_primitives()`` lists them; ``help(sch.shard)`` (or ``help(get_primitive("shard"))``)
shows a primitive's documentation.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable

_PRIMITIVES: dict[str, Callable] = {}


def register_primitive(name: str | None = None):
    """Decorator registering a schedule primitive under ``name`` (default: function name)."""
    def wrap(fn: Callable) -> Callable:
        key = name or fn.__name__
        if key in _PRIMITIVES:
            raise ValueError(f"primitive '{key}' is registered twice")
        _PRIMITIVES[key] = fn
        return fn
    return wrap


def get_primitive(name: str) -> Callable:
    if name not in _PRIMITIVES:
        close = difflib.get_close_matches(name, _PRIMITIVES, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise KeyError(f"unknown primitive '{name}'{hint}")
    return _PRIMITIVES[name]


def list_primitives() -> list[str]:
    """The names of all registered primitives, sorted."""
    return sorted(_PRIMITIVES)


# Importing the modules registers the primitives.
from . import (  # noqa: E402,F401  # noqa: E402,F401  (static graphs)
    annotate,
    checkpoint,
    compile,
    cut_pipeline_stage,
    decompose,
    find,
    fork_rng,
    fuse,
    replace,
    shard,
    sync,
    trace,
)
