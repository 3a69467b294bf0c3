"""trace: turn a module into a static graph (a torch.fx GraphModule) in the schedule tree."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from .. import state
from ..hooks import move_hooks
from ..tracing import is_inert_hook, is_traced, trace_module
from ..tracing.adapter import adapter_of
from ..tracing.hf_inputs import example_inputs_from_config, skipped_mask_makers
from . import register_primitive
from .decompose import split_hooked_biases

# Upstream Slapo's tracer names. There is one tracer here (torch.fx with example values); it
# traces HF blocks too, so every name selects it: "huggingface" insists on example inputs
# made from the model config (slapo.tracing.hf_inputs), and "dynamo" takes the tensors of
# concrete_args as the example call, as upstream's TorchDynamo capture did.
TRACERS = ("pytorch", "huggingface", "dynamo")


@register_primitive()
def trace(sch, recursive: bool = True, flatten: bool = False, leaves: Iterable = (),
          tracer: str = "pytorch", concrete_args: dict | None = None, config=None,
          example_inputs=None, leaf_modules: Iterable = ()) -> bool:
    """Trace this node's module with torch.fx and put the GraphModule in its place; returns
    True (upstream Slapo's return value; a failure here raises instead of returning False).

    - ``recursive``: True traces into the submodules too; False traces only this module's
      own forward, each child (each item of a child ModuleList/ModuleDict) staying a call,
      unless ``flatten`` (as upstream, which then inlines the children all the same).
    - ``leaves`` (upstream's ``leaf_modules``, which is taken too): submodules kept as calls
      rather than traced into: classes, class names, or paths relative to this node
      (shell-style patterns allowed, e.g. ``"layer.*.attention"``). ``torch.nn`` modules,
      slapo's fused/decomposed modules and modules that primitives already changed (``sync``,
      ``checkpoint``, ``fork_rng``, a sharded row-parallel Linear) are always leaves.
    - ``flatten``: False keeps the hierarchy (each non-leaf submodule becomes a GraphModule at
      its path, so ``sch["layer.0.attention"]`` still exists); True gives one graph that calls
      only leaves, so the modules below this node's children have no schedule nodes (as
      upstream: ``sch["attention.self"]`` of a flattened layer is an error saying so, and
      ``sch.get_module("attention.self")`` reaches the module).
    - ``tracer``: upstream's names, ``"pytorch"``, ``"huggingface"`` or ``"dynamo"``, all
      this one tracer (it traces HF blocks). A module of a transformers model traced without
      ``example_inputs`` gets them made from the model's config (``config``, else the
      module's or its nearest ancestor's ``config``) for the usual argument names
      (``input_ids``, ``attention_mask``, ``hidden_states`` ...), as upstream's HF tracer
      made dummy inputs; ``"huggingface"`` requires that (an argument it cannot make is an
      error). ``"dynamo"`` takes the tensors given in ``concrete_args`` as the example call
      (upstream's TorchDynamo capture ran the module on them); the graph keeps module calls
      and parameter names, where TorchDynamo would inline and rename them.
    - ``config``: the transformers config those example inputs are made from.
    - ``example_inputs``: a dict of named inputs (or a tuple of positional ones). They become
      the graph's inputs and give every value an example shape, which HF blocks need
      (``x.view(*x.shape[:-1], -1, d)``); the graph still accepts other batch sizes and
      sequence lengths. Without them, the arguments without defaults are the inputs.
    - ``concrete_args``: values for other arguments, fixed while tracing (every argument not
      given as an input is fixed to its default). Calling the traced module with another value
      for a fixed argument raises an error that says so.

    The traced module still accepts its original call signature, and the hooks registered on the
    module (with torch, or by ``sync``) run around it as they did (a forward that ``checkpoint``
    or ``fork_rng`` replaced cannot be traced: trace first). The subtree below this node is
    rebuilt: its children are the submodules the graph still calls (plain attributes such as
    ``config`` are kept; parameters the graph never uses are dropped). Parameter names do not
    change, and random ops run in the same order, so dropout draws the same masks. What Python
    decided while tracing is fixed in the graph: branches on shapes and flags, the train/eval
    mode HF attention reads (a warning says when the mode changes later), and attribute values
    such as a head count, so shard a module before tracing it if sharding changes such values.
    Stateless submodules (HF activations) are traced into their caller. A schedule root whose
    loss ``slapo.op.vocab_parallel_loss`` made vocabulary-parallel is traced without that loss
    (its own forward, returning the sharded logits); the schedule keeps the loss, and
    ``build(target="pipeline")`` computes it on the last stage. Tracing an already traced module
    is a no-op. A submodule that cannot be traced stays whole, one call in its parent's graph
    (as upstream Slapo's tracer left it), with a warning naming it and why; make it a leaf to
    keep it whole without one. Raises ``slapo.tracing.TraceError`` when this node's own module
    cannot be traced (upstream returned False), naming the module (path and class) that failed,
    and why.

    Example::

        attn = sch["encoder.layer.0.attention"]
        attn.trace(flatten=True, example_inputs={"hidden_states": torch.randn(2, 16, 64),
                                                 "attention_mask": torch.zeros(2, 1, 16, 16)})
        print(attn.mod.graph)
        sch["encoder.layer.1"].trace(tracer="huggingface", config=model.config)
    """
    where = sch.path or "<root>"
    if tracer not in TRACERS:
        raise ValueError(f"trace of '{where}': unknown tracer {tracer!r}; slapo has one "
                         f"tracer, spelled {', '.join(map(repr, TRACERS))} (it traces HF "
                         "blocks; give example_inputs where shapes matter)")
    if tracer == "dynamo" and example_inputs is None and concrete_args:
        example_inputs = {k: v for k, v in concrete_args.items() if isinstance(v, torch.Tensor)}
        concrete_args = {k: v for k, v in concrete_args.items() if k not in example_inputs}
        example_inputs = example_inputs or None
    if is_traced(sch.mod):
        return True
    # A root whose forward vocab_parallel_loss wrapped is traced without the wrapper (the
    # pipeline's last stage computes that loss); put back if tracing fails.
    loss_fn = state.loss_fn(sch.mod) if sch.parent is None else None
    wrapped = sch.mod.__dict__.pop("forward", None) if loss_fn is not None else None
    try:
        _trace(sch, recursive, flatten, leaves, tracer, concrete_args, config, example_inputs,
               leaf_modules, where)
    except BaseException:
        if wrapped is not None:
            sch.mod.forward = wrapped
        raise
    if loss_fn is not None:
        state.set_pipeline_loss(sch, loss_fn)
    return True


def _trace(sch, recursive, flatten, leaves, tracer, concrete_args, config, example_inputs,
           leaf_modules, where) -> None:
    if "forward" in sch.mod.__dict__:
        raise ValueError(f"'{where}' ({type(sch.mod).__name__}) has a forward replaced by an "
                         "earlier primitive (checkpoint, fork_rng); trace it before applying "
                         "them")
    leaves = [*_as_list(leaves), *_as_list(leaf_modules)]
    if not recursive and not flatten:
        leaves += _children_as_calls(sch.mod)
    if config is None:
        config = _model_config(sch)
    if example_inputs is None:
        example_inputs = _inputs_from_model_config(sch, tracer, config, concrete_args, where)
    gm = trace_module(sch.mod, example_inputs=example_inputs, concrete_args=concrete_args,
                      leaves=leaves, flatten=flatten, path=sch.path)
    if config is not None:  # a block of a transformers model, called as transformers calls it
        adapter = adapter_of(gm)
        adapter.none_makers = skipped_mask_makers(sch.mod, adapter.tensor_inputs)
    split_hooked_biases(gm)
    kept = {id(mod) for mod in sch.mod.modules()}
    for mod in gm.modules():  # the graph module and the ones holding its attributes are new
        if id(mod) not in kept:
            mod.training = sch.mod.training
    # The module's own hooks (registered with torch, or by sync) run around the graph, ahead
    # of the call adapter, so that they see the module's call as before.
    move_hooks(sch.mod, gm, keep=lambda hook: not is_inert_hook(hook))
    if sch.parent is not None:
        setattr(sch.parent.mod, sch.name, gm)
    sch.mod = gm
    sch._rebuild_children()


def _inputs_from_model_config(sch, tracer, config, concrete_args, where):
    """Example inputs made from the transformers config of the model the module belongs to
    (``config``, else the module's or its nearest ancestor's), as upstream's HF tracer made
    them: required for ``tracer="huggingface"``; for other tracers whenever there is such a
    config and every argument to trace has a maker (else None: traced without examples)."""
    if tracer == "huggingface":
        return example_inputs_from_config(sch.mod, config, concrete_args, where)
    if config is None:
        return None
    try:
        return example_inputs_from_config(sch.mod, config, concrete_args, where)
    except (TypeError, ValueError):
        return None


def _model_config(sch):
    """The transformers config of the module at ``sch`` or of its nearest ancestor."""
    node = sch
    while node is not None:
        config = getattr(node.mod, "config", None)
        if any(c.__module__.startswith("transformers.") for c in type(config).__mro__):
            return config
        node = node.parent
    return None


def _as_list(leaves) -> list:
    return [leaves] if isinstance(leaves, (str, type)) else list(leaves)


def _children_as_calls(mod: nn.Module) -> list[str]:
    """The paths of the modules ``mod``'s forward calls directly: its children, and the items
    of the containers among them (a ModuleList is never called itself)."""
    paths = []
    for name, child in mod.named_children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            paths += [f"{name}.{item}" for item, _ in child.named_children()]
        else:
            paths.append(name)
    return paths


@register_primitive()
def trace_until(sch, paths: str | list[str], **kwargs) -> bool:
    """Trace the model from the root down to the modules at ``paths``, whose children stay
    untraced calls (upstream Slapo's ``trace_until``): enough graph to cut pipeline stages
    between those children, the rest of each child left as it is for other primitives.

    ``paths`` are relative to the root, e.g. ``"bert.encoder.layer"`` (the ModuleList whose
    layers become the leaves). ``kwargs`` go to ``trace`` (``example_inputs``,
    ``concrete_args``, ``tracer``, ``flatten``, further ``leaves``)::

        sch.trace_until("bert.encoder.layer", example_inputs={"input_ids": ids},
                        concrete_args={"use_cache": False})
        sch["bert.encoder.layer.5"].cut_pipeline_stage()
    """
    if sch.parent is not None:
        raise ValueError(f"trace_until traces from the root; '{sch.path}' is not the root")
    if is_traced(sch.mod):
        raise ValueError("trace_until: the root is traced already")
    leaves = [*_as_list(kwargs.pop("leaves", ())), *_as_list(kwargs.pop("leaf_modules", ()))]
    for path in [paths] if isinstance(paths, str) else list(paths):
        node = sch[path]
        if not node.child:
            raise ValueError(f"trace_until: '{path}' ({type(node.mod).__name__}) has no "
                             "submodules to stop at")
        prefix = f"{path}." if path else ""  # "" is the root: its children are the stops
        for name, child in node.child.items():
            # a container is never called: its items are the calls to keep (upstream took
            # everything under a leaf path as a leaf)
            if isinstance(child.mod, (nn.ModuleList, nn.ModuleDict)):
                leaves += [f"{prefix}{name}.{item}" for item in child.child]
            else:
                leaves.append(f"{prefix}{name}")
    return trace(sch, leaves=leaves, **kwargs)


@register_primitive()
def trace_for_pipeline(sch, paths: str | list[str], **kwargs) -> bool:
    """Upstream Slapo's name for :func:`trace_until` (its model schedules call it before they
    cut pipeline stages)."""
    return trace_until(sch, paths, **kwargs)
