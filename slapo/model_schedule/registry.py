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
"""

from __future__ import annotations

from collections.abc import Callable

SCHEDULE_METHODS: dict[str, dict[str, Callable]] = {}


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
