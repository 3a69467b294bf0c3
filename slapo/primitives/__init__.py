"""The schedule primitives: one module each, registered by name in ``base``'s registry.

``slapo.list_primitives()`` lists them; ``help(sch.shard)`` (or ``help(get_primitive("shard"))``)
shows a primitive's documentation.
"""

from .base import Primitive, get_primitive, list_primitives, register_primitive

__all__ = ["Primitive", "get_primitive", "list_primitives", "register_primitive"]

# Importing the modules registers the primitives.
from . import (  # noqa: E402,F401
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
