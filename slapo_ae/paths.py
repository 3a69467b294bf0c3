"""The checkout's layout, in one place: the artifact runs from a clone of the repository."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
MODEL_CONFIGS = CONFIGS / "models"  # overridden by $SLAPO_MODEL_CONFIGS (zoo.configs)
# DeepSpeed compiles its CPU ops on first use into this cache (the Makefile points there too).
TORCH_EXTENSIONS = ROOT / ".cache" / "torch_extensions"
