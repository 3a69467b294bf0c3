"""Upstream Slapo's other name for :mod:`slapo.framework_dialect`: the same registry and
dialects, so that upstream's scripts that import from either run (``from slapo.model_dialect
import get_dialect_cls``, ``slapo.model_dialect.deepspeed.pipeline.analyze_tie_ranks``)."""

from __future__ import annotations

import sys

from .. import framework_dialect
from ..framework_dialect import (
    KINDS,
    deepspeed,
    get_all_dialects,
    get_dialect_cls,
    megatron,
    register_framework_dialect,
)

# the submodules under this name too, for `import slapo.model_dialect.deepspeed.pipeline`
for _name in ("deepspeed", "deepspeed.pipeline", "megatron", "logs"):
    sys.modules[f"{__name__}.{_name}"] = sys.modules[f"{framework_dialect.__name__}.{_name}"]

__all__ = ["KINDS", "deepspeed", "get_all_dialects", "get_dialect_cls", "megatron",
           "register_framework_dialect"]
