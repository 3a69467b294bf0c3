"""Upstream Slapo's registry of model schedules, for schedules written upstream's way.

Upstream split a model's schedule into functions registered under the model's short name
(the last part of ``config._name_or_path`` up to its first ``-``: ``"bert"`` for
``"bert-large-uncased"``, ``"gpt_neo"`` for ``"EleutherAI/gpt-neo-1.3B"``), each named for
its step, which ``apply_schedule`` called in turn:

    @register_schedule_method("mymodel")
    def shard_parameters(sch, model_config, sch_config): ...

    @register_schedule_method("mymodel")
    def checkpoint(sch, model_config, ckpt_ratio=1.0, checkpoint_method="uniform"): ...

``apply_schedule`` (``api.py``) runs a model's registered steps this way when its short name
(or its ``model_type``) has any; the families this package ships are one ``schedule(sch,
opts)`` each and are not in this registry.

Upstream's last form registers one function per file, under the file's name, which takes the
model and the whole configuration (``model_config`` among its keywords) and returns the
schedule; ``apply_schedule(model, "<file name>", model_config=..., ...)`` calls it:

    # mymodel.py
    @register_schedule()
    def _apply_schedule(model, **sch_config): ...

``get_schedule(name)`` gives it; for a family this package ships and nobody registered, a
function of the same form that applies the package's schedule (upstream's RoBERTa schedule
delegates to ``get_schedule("bert")``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

SCHEDULE_METHODS: dict[str, dict[str, Callable]] = {}  # upstream's steps, per short name
SCHEDULES: dict[str, Callable] = {}  # upstream's last form: one function per file name


def register_schedule_method(model_name: str):
    """Decorator registering a schedule step for ``model_name`` under the function's name."""
    def decorator(method: Callable) -> Callable:
        methods = SCHEDULE_METHODS.setdefault(model_name, {})
        if method.__name__ in methods:
            raise ValueError(f"schedule method {method.__name__} is already registered for "
                             f"{model_name}")
        methods[method.__name__] = method
        return method
    return decorator


def get_schedule_method(model_name: str, schedule_name: str) -> Callable | None:
    """The step ``schedule_name`` registered for ``model_name``, or None."""
    return SCHEDULE_METHODS.get(model_name, {}).get(schedule_name)


def short_name(model_config) -> str | None:
    """Upstream's short name of a model: from ``_name_or_path``, as upstream derived it."""
    path = (model_config.get("_name_or_path") if isinstance(model_config, dict)
            else getattr(model_config, "_name_or_path", None))
    if not path:
        return None
    name = str(path).split("/")[-1].split("-")[0]
    return "gpt_neo" if name == "gpt" else name


def register_schedule():
    """Decorator registering a whole schedule ``fn(model, **sch_config) -> sch`` under the name
    of the file that defines it (upstream's: ``bert.py`` registers ``"bert"``)."""
    def decorator(method: Callable) -> Callable:
        name = inspect.getfile(method).split("/")[-1].split(".")[0]
        if name in SCHEDULES:
            raise ValueError(f"Schedule method for {name} already exists.")
        SCHEDULES[name] = method
        return method
    return decorator


def get_schedule(model_name: str) -> Callable:
    """The schedule registered under ``model_name`` (``register_schedule``), else the package's
    own for a family it ships; a ValueError for any other name."""
    if model_name in SCHEDULES:
        return SCHEDULES[model_name]
    from . import FAMILIES

    if model_name not in FAMILIES:
        raise ValueError(f"Schedule for {model_name} does not exist.")

    def family_schedule(model, **sch_config):
        from .api import apply_schedule

        key = sch_config.pop("schedule_key", model_name)
        if key != model_name:
            raise ValueError(f"the schedule of {model_name} given schedule_key={key!r}")
        model_config = sch_config.pop("model_config", None) or model.config
        return apply_schedule(model, model_config, schedule_key=model_name, **sch_config)

    return family_schedule
