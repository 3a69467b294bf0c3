"""Thin entry point of the rules: run a module of ``slapo.bench`` as ``python -m`` would,
without importing torch.

    python workflow/scripts/run_module.py slapo.bench.aggregate --experiment e2e ...

``import slapo.bench.x`` runs ``slapo/__init__.py`` first, which loads the schedule language
and torch (seconds per process). The workflow's own modules (case runner, aggregation, plots,
claims, Table 4) need none of it, so the ``slapo`` and ``slapo.bench`` packages are registered
here as plain namespaces of this checkout, their ``__init__`` files skipped.
"""
import runpy
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def light_slapo(root: Path = ROOT) -> None:
    """Make ``slapo`` and ``slapo.bench`` importable from ``root`` without their ``__init__``."""
    for name, rel in (("slapo", "slapo"), ("slapo.bench", "slapo/bench")):
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__path__ = [str(root / rel)]
            sys.modules[name] = module


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: run_module.py MODULE [ARGS...]")
    light_slapo()
    module = sys.argv[1]
    sys.argv = [module, *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
