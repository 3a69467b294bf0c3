"""Runtime engines that ``slapo.build(sch, target=...)`` hands the scheduled model to.

The one import of a training framework in the schedule language, made only when the target is
asked for (the import-linter contract allows this module alone to import DeepSpeed).
"""

from __future__ import annotations

from torch import nn


def deepspeed_engine(model: nn.Module, config=None, optimizer=None, **kwargs) -> tuple:
    """``deepspeed.initialize`` on ``model`` with ``config`` (a dict or a JSON path; required)
    and ``optimizer`` (a ``torch.optim.Optimizer``, or None to let the config name one);
    other keyword arguments go to ``deepspeed.initialize``. Returns ``(engine, optimizer)``:
    the engine is called and stepped as DeepSpeed's (``engine(**batch)``,
    ``engine.backward(loss)``, ``engine.step()``)."""
    if config is None:
        raise ValueError("build(target='deepspeed') needs config=, DeepSpeed's configuration "
                         "(a dict or the path of a JSON file)")
    import deepspeed

    params = [p for p in model.parameters() if p.requires_grad] if optimizer is None else None
    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=config,
                                                   optimizer=optimizer,
                                                   model_parameters=params, **kwargs)
    return engine, optimizer
