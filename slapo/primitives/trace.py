"""trace: turn a module into a static graph (a torch.fx GraphModule) in the schedule tree."""

from __future__ import annotations

from collections.abc import Iterable

from ..tracing import has_foreign_hooks, is_traced, trace_module
from . import register_primitive


@register_primitive()
def trace(sch, leaves: Iterable = (), flatten: bool = False, concrete_args: dict | None = None,
          example_inputs=None) -> None:
    """Trace this node's module with torch.fx and put the GraphModule in its place.

    - ``leaves``: submodules kept as calls rather than traced into: classes, class names, or
      paths relative to this node (shell-style patterns allowed, e.g. ``"layer.*.attention"``).
      ``torch.nn`` modules, slapo's fused/decomposed modules and modules that primitives
      already changed (``sync``, ``checkpoint``, ``fork_rng``, a sharded row-parallel Linear)
      are always leaves.
    - ``flatten``: False keeps the hierarchy (each non-leaf submodule becomes a GraphModule at
      its path, so ``sch["layer.0.attention"]`` still exists); True gives one graph that calls
      only leaves.
    - ``example_inputs``: a dict of named inputs (or a tuple of positional ones). They become
      the graph's inputs and give every value an example shape, which HF blocks need
      (``x.view(*x.shape[:-1], -1, d)``); the graph still accepts other batch sizes and
      sequence lengths. Without them, the arguments without defaults are the inputs.
    - ``concrete_args``: values for other arguments, fixed while tracing (every argument not
      given as an input is fixed to its default). Calling the traced module with another value
      for a fixed argument raises an error that says so.

    The traced module still accepts its original call signature. The subtree below this node
    is rebuilt: its children are the submodules the graph still calls (plain attributes such
    as ``config`` are kept; parameters the graph never uses are dropped). Parameter names do
    not change, and random ops run in the same order, so dropout draws the same masks. What
    Python decided while tracing is fixed in the graph: branches on shapes and flags, the
    train/eval mode HF attention reads (a warning says when the mode changes later), and
    attribute values such as a head count, so shard a module before tracing it if sharding
    changes such values. Stateless submodules (HF activations) are traced into their caller.
    Tracing an already traced module is a no-op. Raises ``slapo.tracing.TraceError`` naming the
    module (path and class) that could not be traced, and why.

    Example::

        attn = sch["encoder.layer.0.attention"]
        attn.trace(flatten=True, example_inputs={"hidden_states": torch.randn(2, 16, 64),
                                                 "attention_mask": torch.zeros(2, 1, 16, 16)})
        print(attn.mod.graph)
    """
    if is_traced(sch.mod):
        return
    if has_foreign_hooks(sch.mod):
        raise ValueError(f"'{sch.path or '<root>'}' ({type(sch.mod).__name__}) has hooks or a "
                         "replaced forward from earlier primitives (sync, checkpoint, fork_rng, "
                         "shard); trace it before applying them")
    gm = trace_module(sch.mod, example_inputs=example_inputs, concrete_args=concrete_args,
                      leaves=leaves, flatten=flatten, path=sch.path)
    if sch.parent is not None:
        setattr(sch.parent.mod, sch.name, gm)
    sch.mod = gm
    sch._rebuild_children()


@register_primitive()
def trace_until(sch, paths: str | list[str], **kwargs) -> None:
    """Trace the model from the root down to the modules at ``paths``, whose children stay
    untraced calls (upstream Slapo's ``trace_until``): enough graph to cut pipeline stages
    between those children, the rest of each child left as it is for other primitives.

    ``paths`` are relative to the root, e.g. ``"bert.encoder.layer"`` (the ModuleList whose
    layers become the leaves). ``kwargs`` go to ``trace`` (``example_inputs``,
    ``concrete_args``, ``flatten``, further ``leaves``)::

        sch.trace_until("bert.encoder.layer", example_inputs={"input_ids": ids},
                        concrete_args={"use_cache": False})
        sch["bert.encoder.layer.5"].cut_pipeline_stage()
    """
    if sch.parent is not None:
        raise ValueError(f"trace_until traces from the root; '{sch.path}' is not the root")
    if is_traced(sch.mod):
        raise ValueError("trace_until: the root is traced already")
    leaves = list(kwargs.pop("leaves", ()))
    for path in [paths] if isinstance(paths, str) else list(paths):
        node = sch[path]
        if not node.child:
            raise ValueError(f"trace_until: '{path}' ({type(node.mod).__name__}) has no "
                             "submodules to stop at")
        leaves += [f"{path}.{name}" for name in node.child]
    trace(sch, leaves=leaves, **kwargs)
