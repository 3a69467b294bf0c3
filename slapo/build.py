"""build: turn a schedule into the module to train."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def build(sch, init_weights: Callable[[nn.Module], None] | None = None, target: str = "module",
          **options):
    """Return the scheduled model, ready for an optimizer.

    Primitives take effect as they are applied, so ``build`` only finishes the model:
    ``init_weights(module)``, when given, is called on every submodule (under ``no_grad``) to
    initialise parameters after sharding, for example on a model created on the meta device
    and materialised with ``to_empty``. Parameters still on the meta device are an error.

    ``target="pipeline"`` (after ``trace`` and ``cut_pipeline_stage``) splits the traced model
    into one stage per rank and returns a ``slapo.pipeline.PipelineBuild`` for
    ``torch.distributed.pipelining``; ``options`` go to ``slapo.pipeline.build_pipeline``
    (``n_microbatches``, ``loss_fn``, ``schedule="GPipe"``, ``group``, ``device``)::

        pipe = slapo.build(sch, target="pipeline", n_microbatches=4, loss_fn=loss_fn)
    """
    if target == "pipeline":
        from .pipeline import build_pipeline
        pipe = build_pipeline(sch, **options)
        _finish(pipe.module, init_weights)
        return pipe
    if target != "module" or options:
        raise ValueError(f"unknown build target {target!r} (expected 'module' or 'pipeline')"
                         if target != "module" else
                         f"unexpected options for target 'module': {', '.join(options)}")
    return _finish(sch.mod, init_weights)


def _finish(model: nn.Module, init_weights) -> nn.Module:
    if init_weights is not None:
        with torch.no_grad():
            model.apply(init_weights)
    meta = [name for name, p in model.named_parameters() if p.is_meta]
    if meta:
        raise ValueError(f"parameters still on the meta device after build: {', '.join(meta[:5])}"
                         f"{' ...' if len(meta) > 5 else ''}; materialise them (to_empty) and pass "
                         "init_weights")
    return model
