"""``apply_schedule``: upstream Slapo's entry point to the model schedules
(``slapo.model_schedule.apply_schedule(model, model_config, **sch_config)``).

Upstream keys and what they do here:

- ``fp16`` / ``bf16``: cast the model to half / bfloat16 before scheduling (both: an error);
- ``group``: the process group of tensor parallelism (``create_schedule(model, group=)``);
- ``prefix``: the path of the base model (``"transformer"``, ``"bert"``, ...), checked to name
  a module of the model; the family schedules find their layers from the root themselves;
- ``ckpt_ratio``: checkpoint that share of the layers, the first ones (``checkpoint_method``
  ``"head"``); upstream's ``"uniform"`` spacing is refused for ratios strictly between 0 and 1
  (at 0 and 1 both methods checkpoint the same layers);
- ``attn_op_name``: accepted; every attention runs on ``scaled_dot_product_attention``;
- ``delay_init``: accepted; the schedules keep the model's weights, nothing is re-created;
- ``bcast_input``, ``sequence_parallel``, ``pipeline_cuts``, ``disable_fuse_bias_gelu``
  (BERT's): accepted when off (False, None, empty), refused when on (not part of these
  schedules; ``kernel_opt=False`` keeps the model's own kernels).

Keys of ``ScheduleOptions`` (``tensor_parallel``, ``shard_embedding``, ``kernel_opt``,
``device``, ``compile_layers``) pass through. Any other key is an error that names it.

A model with schedule steps registered upstream's way (``registry.register_schedule_method``,
under its short name or its ``model_type``) is scheduled by those steps instead, as upstream's
``apply_schedule`` did: ``fp16``/``bf16``, then ``shard_parameters(sch, model_config,
sch_config)``, ``broadcast_input(sch)`` (with ``bcast_input`` on several ranks),
``checkpoint(sch[prefix], model_config, ckpt_ratio=, checkpoint_method=)`` (with ``ckpt_ratio``
above 0) and ``generate_pipeline_schedule(sch, model_config, sch_config)`` (with
``pipeline_cuts``); ``sch_config`` is theirs to read. A step that is asked for and not
registered is an error (upstream skipped it silently, so the run went on unsharded, or
without checkpoints).
"""

from __future__ import annotations

from ..schedule import create_schedule
from . import model_type, schedule_model
from .registry import SCHEDULE_METHODS, get_schedule_method, short_name

_OPTION_KEYS = ("tensor_parallel", "shard_embedding", "kernel_opt", "ckpt_ratio", "device",
                "compile_layers")
_ACCEPTED = ("fp16", "bf16", "group", "prefix", "checkpoint_method", "attn_op_name",
             "delay_init")
_OFF_ONLY = ("bcast_input", "sequence_parallel", "pipeline_cuts", "disable_fuse_bias_gelu")


def apply_schedule(model, model_config, **sch_config):
    """Schedule ``model`` as its family's schedule does and return the schedule (``sch``;
    ``slapo.build(sch)`` then gives the model). The family comes from
    ``model_config.model_type`` (a transformers config, or a dict with ``"model_type"``),
    which must agree with the model's own config. See the module docstring for the keys, and
    for models whose schedule steps are registered upstream's way."""
    registered = _registered_name(model_config)
    if registered is not None:
        return _apply_registered(model, model_config, registered, sch_config)
    unknown = sorted(set(sch_config) - set(_OPTION_KEYS + _ACCEPTED + _OFF_ONLY))
    if unknown:
        raise ValueError(f"apply_schedule: unknown schedule config key(s) {', '.join(unknown)}; "
                         f"known: {', '.join(sorted(_OPTION_KEYS + _ACCEPTED + _OFF_ONLY))}")
    on = [key for key in _OFF_ONLY if sch_config.get(key)]
    if on:
        raise NotImplementedError(f"apply_schedule: {', '.join(on)} not supported by slapo's "
                                  "model schedules; leave it off")
    method, ratio = sch_config.get("checkpoint_method", "head"), sch_config.get("ckpt_ratio", 0)
    if method not in ("head", "uniform"):
        raise ValueError(f"apply_schedule: unknown checkpoint_method {method!r}; expected "
                         "'head' or 'uniform'")
    if method == "uniform" and 0 < ratio < 1:  # at 0 and 1 the two methods agree
        raise NotImplementedError("apply_schedule: checkpoint_method 'uniform' (every "
                                  "1/ckpt_ratio-th layer) not supported; the schedules "
                                  "checkpoint the first layers ('head')")
    family = _config_type(model_config)
    if family is None:
        raise ValueError("apply_schedule: model_config has no model_type to choose the schedule")
    own = model_type(model)
    if own is not None and own != family:
        raise ValueError(f"apply_schedule: model_config says {family!r} but the model is a "
                         f"{type(model).__name__} of type {own!r}")
    _cast(model, sch_config)
    prefix = sch_config.get("prefix", "")
    if prefix and prefix not in dict(model.named_modules()):
        raise ValueError(f"apply_schedule: prefix {prefix!r} names no module of "
                         f"{type(model).__name__}")
    sch = create_schedule(model, group=sch_config.get("group"))
    schedule_model(sch, family, **{key: sch_config[key] for key in _OPTION_KEYS
                                   if key in sch_config})
    return sch


def _config_type(model_config) -> str | None:
    if isinstance(model_config, dict):
        return model_config.get("model_type")
    return getattr(model_config, "model_type", None)


def _cast(model, sch_config) -> None:
    fp16, bf16 = sch_config.get("fp16", False), sch_config.get("bf16", False)
    if fp16 and bf16:
        raise ValueError("apply_schedule: cannot use both fp16 and bf16")
    if fp16:
        model.half()
    elif bf16:
        model.bfloat16()


def _registered_name(model_config) -> str | None:
    """The name the model's steps are registered under (upstream's short name first)."""
    for name in (short_name(model_config), _config_type(model_config)):
        if name is not None and SCHEDULE_METHODS.get(name):
            return name
    return None


def _apply_registered(model, model_config, name: str, sch_config: dict):
    """Upstream's apply_schedule over the steps registered for ``name``."""
    def step(step_name: str, why: str):
        method = get_schedule_method(name, step_name)
        if method is None:
            raise NotImplementedError(f"apply_schedule: {why}, but no {step_name} is "
                                      f"registered for {name!r} (registered: "
                                      f"{', '.join(sorted(SCHEDULE_METHODS[name]))})")
        return method

    _cast(model, sch_config)
    sch = create_schedule(model, group=sch_config.get("group"))
    if get_schedule_method(name, "shard_parameters") is not None or sch.world_size > 1:
        step("shard_parameters", f"the model is sharded over {sch.world_size} ranks")(
            sch, model_config, sch_config)
    if sch.world_size > 1 and sch_config.get("bcast_input", False):
        step("broadcast_input", "bcast_input is on")(sch)
    ratio = sch_config.get("ckpt_ratio", 0.0)
    if ratio > 0.0:
        step("checkpoint", f"ckpt_ratio is {ratio}")(
            sch[sch_config.get("prefix", "")], model_config, ckpt_ratio=ratio,
            checkpoint_method=sch_config.get("checkpoint_method", "uniform"))
    if sch_config.get("pipeline_cuts"):
        step("generate_pipeline_schedule", "pipeline_cuts are given")(
            sch, model_config, sch_config)
    return sch
