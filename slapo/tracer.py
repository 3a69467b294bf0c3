"""Upstream Slapo's ``slapo.tracer.trace(model, **kwargs)``: a model traced to a GraphModule.

Here the ``trace`` primitive's tracer (``slapo.tracing``) does the work; ``sch.trace(...)`` is
the way to trace inside a schedule.
"""

from __future__ import annotations

from torch import fx, nn

from .schedule import create_schedule


def trace(model: nn.Module, **kwargs) -> fx.GraphModule:
    """``model`` traced as ``slapo.create_schedule(model).trace(**kwargs)`` traces it (the same
    keywords: ``recursive``, ``flatten``, ``leaf_modules``, ``tracer``, ``concrete_args``,
    ``config``, ``example_inputs``), returned as the GraphModule. Hooks on ``model`` move to the
    GraphModule, as the primitive moves them; the submodules are shared with ``model``."""
    sch = create_schedule(model)
    sch.trace(**kwargs)
    return sch.mod
