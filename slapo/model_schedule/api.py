"""``apply_schedule``: upstream Slapo's entry point to the model schedules
(``slapo.model_schedule.apply_schedule(model, model_config, **sch_config)``).

Upstream keys and what they do here:

- ``fp16`` / ``bf16``: cast the model to half / bfloat16 before scheduling (both: an error);
- ``group``: the process group of tensor parallelism (``create_schedule(model, group=)``);
- ``schedule_key``: the family's name (``"gpt_neo"``, ...), where upstream's examples named it
  instead of relying on the config's model name; it must agree with the model;
- ``prefix``: the path of the base model (``"transformer"``, ``"bert"``, ...), checked to name
  a module of the model; the family schedules find their layers from the root themselves,
  except WideResNet's, scheduled at ``prefix`` (upstream's example wraps torchvision's model
  in a module that adds the loss);
- ``fuse_conv`` (WideResNet's): each bottleneck block one Inductor region (upstream replaced
  each by a TorchScript trace), compiled before it is sharded and checkpointed;
- ``ckpt_ratio``: checkpoint that share of the layers: the first ones (``checkpoint_method``
  ``"head"``, the default here; ALBERT: the first calls of its shared layers), or, as
  upstream's default ``"uniform"``, every ``int(1 / ckpt_ratio)``-th layer from the first
  (BERT, RoBERTa, GPT-2, GPT-Neo, OPT, LLaMA; refused for T5, WideResNet and ALBERT between 0
  and 1, where the two methods differ);
- ``pipeline_cuts``: refused for ALBERT, whose layers share their weights (upstream's ALBERT
  schedule cut ``encoder.layer.N``, which ALBERT lacks); a list of layer indices (BERT,
  RoBERTa, GPT-2, GPT-Neo, OPT, LLaMA), or, in
  upstream's form for models with several layer lists, one list for each: WideResNet's
  ``layer1`` .. ``layer4``; T5's ``encoder.block`` and ``decoder.block``, with a stage
  boundary after the encoder as well. The root is traced as upstream's
  ``generate_pipeline_schedule`` traced it (``trace_for_pipeline`` down to the layer lists,
  whose layers stay calls; upstream's inputs stay arguments, in the forward's order:
  ``input_ids`` and ``attention_mask``, with ``token_type_ids`` (BERT) or ``position_ids``
  (GPT-2, GPT-Neo, LLaMA), as upstream's examples feed them (RoBERTa and OPT: those two), or
  with ``decoder_input_ids`` and ``decoder_attention_mask`` (T5), the first argument of the
  root's forward (WideResNet: the zoo model's ``pixel_values``, ``x`` of upstream's
  torchvision model and of its example's wrapper, at ``prefix``); every other
  argument is fixed at its default, ``use_cache`` off) and a pipeline stage is cut after each
  listed layer; ``slapo.build(sch, target="deepspeed", topology=...)`` (or
  ``target="pipeline"``) then runs the stages;
- ``bcast_input``: with tensor parallelism, a ``fwd_pre`` sync on the root broadcasts each
  tensor passed positionally from the first rank of the schedule's group, as upstream's
  ``broadcast_input`` did (a pipeline calls its stages, not the root: there it does nothing,
  as upstream's did not);
- ``attn_op_name``: accepted; every attention runs on ``scaled_dot_product_attention``;
- ``delay_init``: accepted; the schedules keep the model's weights, nothing is re-created;
- ``sequence_parallel``, ``disable_fuse_bias_gelu`` (BERT's): accepted when off (False, None),
  refused when on (not part of these schedules; ``kernel_opt=False`` keeps the model's own
  kernels).

Keys of ``ScheduleOptions`` (``tensor_parallel``, ``shard_embedding``, ``kernel_opt``,
``device``, ``compile_layers``) pass through. Any other key is an error that names it.

Upstream's last form names the schedule instead of the config,
``apply_schedule(model, "bert", model_config=config, **sch_config)``: the schedule registered
under that name with ``registry.register_schedule()`` (by its file's name), else the
package's own family of that name, gets the model and every keyword (``model_config``
included) and returns the schedule. A schedule so registered under the model's short name or
``model_type`` is also what ``apply_schedule(model, config, ...)`` runs.

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

import inspect

from ..schedule import create_schedule
from ..tracing.hf_inputs import named_example_inputs
from . import model_type, schedule_model
from .common import bottleneck_blocks
from .registry import SCHEDULE_METHODS, SCHEDULES, get_schedule, get_schedule_method, short_name

_OPTION_KEYS = ("tensor_parallel", "shard_embedding", "kernel_opt", "ckpt_ratio", "device",
                "compile_layers")
_ACCEPTED = ("fp16", "bf16", "group", "prefix", "checkpoint_method", "attn_op_name",
             "delay_init", "bcast_input", "pipeline_cuts", "schedule_key", "fuse_conv")
_OFF_ONLY = ("sequence_parallel", "disable_fuse_bias_gelu")

# Each family's list of layers, within its base model (upstream's paths below ``prefix``):
# where upstream's uniform checkpointing and pipeline cuts find the layers.
LAYER_LISTS = {"bert": "encoder.layer", "roberta": "encoder.layer", "gpt2": "h",
               "gpt_neo": "h", "opt": "decoder.layers", "llama": "layers"}
# The arguments the first pipeline stage of each family takes, in this order (upstream's
# input names for each); every family is cut (tested: a tiny model of each trains like the
# plain one on DeepSpeed's pipeline engine).
PIPELINE_INPUTS = {"bert": ("input_ids", "attention_mask", "token_type_ids"),
                   # as upstream's RoBERTa example feeds it (RoBERTa has one token type;
                   # its model schedule named token_type_ids too, which the example lacks)
                   "roberta": ("input_ids", "attention_mask"),
                   "gpt2": ("input_ids", "attention_mask", "position_ids"),
                   "gpt_neo": ("input_ids", "attention_mask", "position_ids"),
                   # upstream named position_ids too, which transformers 4's OPT did not
                   # take: its stages took these two (OPT's positions come from the mask)
                   "opt": ("input_ids", "attention_mask"),
                   "llama": ("input_ids", "attention_mask", "position_ids"),
                   "t5": ("input_ids", "attention_mask", "decoder_input_ids",
                          "decoder_attention_mask"),
                   # the first argument of the root's forward: the zoo's pixel_values,
                   # x of torchvision's model and of upstream's wrapper with its loss
                   "wideresnet": ("pixel_values",)}
# Families no pipeline_cuts can cut, and why.
NOT_CUT = {"albert": "ALBERT's layers share their weights (its encoder calls one layer once "
                     "for each of the model's layers), so no pipeline stage can own a layer"}
# Families whose layers are in several lists, and their pipeline_cuts one list of layer
# indices for each (upstream's form): WideResNet [[cuts in layer1], .., [.. layer4]]; T5
# [[cuts in encoder.block], [.. decoder.block]], with a cut after the encoder as well.
LAYER_GROUPS = {"wideresnet": ("layer1", "layer2", "layer3", "layer4"),
                "t5": ("encoder.block", "decoder.block")}


def apply_schedule(model, model_config=None, /, **sch_config):
    """Schedule ``model`` as its family's schedule does and return the schedule (``sch``;
    ``slapo.build(sch)`` then gives the model). The family comes from ``schedule_key`` or
    ``model_config.model_type`` (a transformers config, or a dict with ``"model_type"``),
    which must agree with the model's own config. See the module docstring for the keys, and
    for models whose schedules are registered upstream's ways.

    Upstream's last form, ``apply_schedule(model, "bert", model_config=config, **sch_config)``,
    calls ``registry.get_schedule("bert")(model, model_config=config, **sch_config)``."""
    if isinstance(model_config, str):
        return get_schedule(model_config)(model, **sch_config)
    if model_config is None:
        if "model_config" not in sch_config:
            raise TypeError("apply_schedule: give the model's config: apply_schedule(model, "
                            "model_config, **sch_config), or a schedule's name: "
                            "apply_schedule(model, name, model_config=..., **sch_config)")
        model_config = sch_config.pop("model_config")
    key = sch_config.get("schedule_key")
    whole = key if key in SCHEDULES else _registered_name(model_config, SCHEDULES)
    if whole is not None:  # a schedule of upstream's last form, registered for this model
        config = {k: v for k, v in sch_config.items() if k != "schedule_key"}
        return SCHEDULES[whole](model, model_config=model_config, **config)
    registered = _registered_name(model_config, SCHEDULE_METHODS) if key is None else \
        (key if SCHEDULE_METHODS.get(key) else None)
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
    family = key or _config_type(model_config)
    if family is None:
        raise ValueError("apply_schedule: model_config has no model_type to choose the schedule")
    own = model_type(model)
    if own is not None and own != family:
        said = "schedule_key" if key else "model_config"
        raise ValueError(f"apply_schedule: {said} says {family!r} but the model is a "
                         f"{type(model).__name__} of type {own!r}")
    uniform = method == "uniform" and 0 < ratio < 1  # at 0 and 1 the two methods agree
    if uniform and family not in LAYER_LISTS:
        raise NotImplementedError(f"apply_schedule: checkpoint_method 'uniform' (every "
                                  f"1/ckpt_ratio-th layer) not supported for {family}; its "
                                  "schedule checkpoints the first layers ('head')")
    if sch_config.get("fuse_conv") and family != "wideresnet":
        raise NotImplementedError(f"apply_schedule: fuse_conv is WideResNet's; leave it off "
                                  f"for {family}")
    prefix = sch_config.get("prefix", "")
    if prefix and prefix not in dict(model.named_modules()):
        raise ValueError(f"apply_schedule: prefix {prefix!r} names no module of "
                         f"{type(model).__name__}")
    # WideResNet is scheduled at prefix, as upstream's was (torchvision's model under a
    # wrapper that adds the loss); the other families find their base model themselves
    base_path = prefix if family == "wideresnet" else ""
    cuts = sch_config.get("pipeline_cuts")
    if cuts and family in NOT_CUT:
        raise NotImplementedError(f"apply_schedule: pipeline_cuts {cuts!r}: {NOT_CUT[family]}; "
                                  "train it with tensor and data parallelism")
    if cuts:  # checked before anything changes
        _cut_paths(model, family, cuts, base_path)
    _cast(model, sch_config)
    sch = create_schedule(model, group=sch_config.get("group"))
    base = sch[base_path] if base_path else sch
    options = {key: sch_config[key] for key in _OPTION_KEYS if key in sch_config}
    if uniform:
        options["ckpt_ratio"] = 0.0  # checkpointed below, every 1/ratio-th layer
    if sch_config.get("fuse_conv"):
        # upstream's conv-block fusion (each block a TorchScript trace): here each block one
        # Inductor region, compiled before the schedule shards and checkpoints it
        for block in bottleneck_blocks(base):
            block.compile(dynamic=False)
    schedule_model(base, family, **options)
    if uniform:
        layers = _layers(sch, family)
        for layer in layers[::max(1, int(1 / ratio))]:
            layer.checkpoint()
    if sch.world_size > 1 and sch_config.get("bcast_input", False):
        sch.sync("fwd_pre", _broadcast_inputs(sch.group))
    if cuts:
        _cut_pipeline_stages(sch, family, cuts, base_path)
    return sch


def layer_list_path(model, family: str) -> str:
    """The path of the family's layer list in ``model`` (with or without its head)."""
    rel = LAYER_LISTS[family]
    paths = [name for name, _ in model.named_modules() if name == rel or name.endswith("." + rel)]
    if not paths:
        raise ValueError(f"apply_schedule: {type(model).__name__} has no {rel!r} layer list "
                         f"of a {family} model")
    return min(paths, key=len)


def _layers(sch, family: str) -> list:
    path = layer_list_path(sch.mod, family)
    return [sch[f"{path}.{i}"] for i in range(len(sch[path].mod))]


def _broadcast_inputs(group):
    """Upstream's ``broadcast_input`` hook: the positional tensors from the group's first rank
    (in place, as upstream's; see ``broadcast_from_first``)."""
    from ..sharding import broadcast_from_first

    return lambda module, inputs: tuple(broadcast_from_first(list(inputs), group))


def _cut_paths(model, family: str, cuts, base_path: str = "") -> tuple[list[str], list[str]]:
    """The paths of the layers to cut after, and of the layer lists to trace until, for
    ``pipeline_cuts`` (WideResNet's below ``base_path``); a ValueError where the cuts are not
    layers of the model."""
    if family in LAYER_GROUPS:
        groups = tuple(f"{base_path}.{name}" if base_path else name
                       for name in LAYER_GROUPS[family])
        counts = [len(model.get_submodule(name)) for name in groups]
        if not isinstance(cuts, (list, tuple)) or len(cuts) != len(counts) or \
                not all(isinstance(c, (list, tuple)) for c in cuts):
            raise ValueError(f"apply_schedule: pipeline_cuts {cuts!r} for {family} must be "
                             f"{len(counts)} lists of layer indices, one for each of "
                             f"{', '.join(groups)} (layers {counts})")
        for k, (name, count, within) in enumerate(zip(groups, counts, cuts)):
            # a last stage computes; T5's encoder ends a stage after its last block anyway
            last = count - 1 if k < len(counts) - 1 and family != "t5" else count - 2
            _check_indices(within, last, f"{name} ({count} layers)")
        paths = [f"{name}.{cut}" for name, within in zip(groups, cuts) for cut in within]
        if family == "t5":  # upstream's: the encoder and the decoder in stages of their own
            return (paths[:len(cuts[0])] + ["encoder"] + paths[len(cuts[0]):],
                    ["encoder", "decoder"])
        if not paths:
            raise ValueError(f"apply_schedule: pipeline_cuts {cuts!r} cut no stage")
        return paths, [name for name, within in zip(groups, cuts) if within]
    path = layer_list_path(model, family)
    count = len(model.get_submodule(path))
    _check_indices(cuts, count - 2, f"the model ({count} layers)")
    return [f"{path}.{cut}" for cut in cuts], [path.rpartition(".")[0]]


def _check_indices(cuts, last: int, where: str) -> None:
    if last < 0 and cuts:
        raise ValueError(f"apply_schedule: pipeline_cuts {cuts!r}: no stage can be cut in "
                         f"{where} (a last stage must compute)")
    if not isinstance(cuts, (list, tuple)) or any(not isinstance(c, int) for c in cuts) or \
            list(cuts) != sorted(set(cuts)) or not all(0 <= cut <= last for cut in cuts):
        raise ValueError(f"apply_schedule: pipeline_cuts {cuts!r} in {where} must be "
                         f"increasing layer indices from 0 to {last} (a stage is cut after each)")


def _cut_pipeline_stages(sch, family: str, cuts, base_path: str = "") -> None:
    """Upstream's ``generate_pipeline_schedule``: trace the root down to the layer lists (their
    layers stay calls), its inputs the family's ``PIPELINE_INPUTS``, and cut a stage after each
    layer of ``cuts`` (checked before anything was scheduled)."""
    cut_after, trace_until = _cut_paths(sch.mod, family, cuts, base_path)
    parameters = inspect.signature(sch.mod.forward).parameters
    inputs = PIPELINE_INPUTS[family] if family != "wideresnet" else (next(iter(parameters)),)
    fixed = {p.name: p.default for p in parameters.values()
             if p.name not in inputs and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    if "use_cache" in fixed:
        fixed["use_cache"] = False  # a pipeline keeps no cache (upstream's scripts set it off)
    config = getattr(sch.mod, "config", None)
    examples = None if family == "wideresnet" else \
        named_example_inputs(sch.mod, config, PIPELINE_INPUTS[family])
    sch.trace_for_pipeline(trace_until, example_inputs=examples, concrete_args=fixed)
    for path in cut_after:
        sch[path].cut_pipeline_stage()


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


def _registered_name(model_config, registry: dict) -> str | None:
    """The name the model's schedule is registered under in ``registry`` (upstream's short
    name first, then the ``model_type``)."""
    for name in (short_name(model_config), _config_type(model_config)):
        if name is not None and registry.get(name):
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
