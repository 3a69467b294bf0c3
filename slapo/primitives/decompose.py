"""decompose: split a Linear in a traced graph into a matmul and a separate bias add."""

from __future__ import annotations

import operator

import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from .. import state
from ..hooks import move_hooks
from ..tracing import KIND, has_foreign_hooks, is_inert_hook
from . import register_primitive


@state.leaf_class
@state.attr_aliases(bias="decomposed_bias")
class DecomposedLinear(nn.Linear):
    """The matmul of a Linear; the enclosing graph adds the bias after the call.

    The parameters keep their names (``weight``, ``bias``) and objects. ``bias`` reads None
    because this module does not add it: sharding then treats it like a bias-free Linear,
    which is right, since the graph adds the bias *after* the module's output (and after a
    ``sync("fwd_post", ...)`` on the module): a row-parallel shard needs no deferred bias,
    and a column-parallel shard of ``weight`` still shards the bias parameter with it. The
    graph reads the parameter as ``decomposed_bias``.
    """

    def __init__(self, linear: nn.Linear):
        nn.Module.__init__(self)
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self._parameters["bias"] = linear.bias
        self.training = linear.training

    @property
    def bias(self):
        return None

    @property
    def decomposed_bias(self) -> nn.Parameter:
        return self._parameters["bias"]

    def forward(self, x):
        return F.linear(x, self.weight)

    def epilogue(self, y):
        """Nothing follows the matmul here (the graph adds the bias): with this, a
        column-parallel shard can overlap its weight gradient (``slapo.sharding.overlap``)."""
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                "bias added by the enclosing graph")


def not_called_reason(sch) -> str:
    """Why no traced graph calls ``sch``'s module (for error messages)."""
    node = sch.parent
    while node is not None:
        reason = state.untraced_reason(node.mod)
        if reason is not None:
            return (f"'{node.path}' ({type(node.mod).__name__}) around it was kept whole by "
                    f"trace, which could not trace it: {reason}")
        node = node.parent
    node = sch.parent
    while node is not None:
        if isinstance(node.mod, fx.GraphModule):
            return (f"'{node.path or '<root>'}' is traced but its graph does not call this module "
                    "itself (it was traced into the graph, or sits inside a leaf): trace with "
                    "flatten=False, or list the module in trace(leaves=[...])")
        node = node.parent
    return "no ancestor is traced: call trace() on an ancestor (for a pipeline: on the root)"


def inlined_reason(sch) -> str | None:
    """Why ``sch``'s module never runs as a module, or None where it does: the nearest traced
    ancestor's graph calls neither it nor a module holding it (a flattening trace inlined it,
    reading its parameters), or that holds for a traced ancestor further up. Its hooks would
    never run."""
    node, below = sch.parent, [sch.name]  # ``below``: the path from ``node`` down to the module
    while node is not None:
        if isinstance(node.mod, fx.GraphModule):
            calls = {n.target for n in node.mod.graph.nodes if n.op == "call_module"}
            if not calls & {".".join(below[:k]) for k in range(1, len(below) + 1)}:
                return (f"the graph of '{node.path or '<root>'}' does not call "
                        f"'{'.'.join(below)}' (its trace inlined it)")
            below = []  # it runs where this graph runs: is the graph itself called?
        below.insert(0, node.name)
        node = node.parent
    return None


def _inside_traced_graph(sch) -> bool:
    """Whether an ancestor of ``sch`` is traced (so its graph, not the module, decides)."""
    node = sch.parent
    while node is not None:
        if isinstance(node.mod, fx.GraphModule):
            return True
        node = node.parent
    return False


def traced_owner(sch):
    """The nearest traced ancestor whose graph calls ``sch``'s module, the module's path in it
    and the calling nodes; None when no traced ancestor calls it."""
    node, rel = sch.parent, sch.name
    while node is not None:
        if isinstance(node.mod, fx.GraphModule):
            calls = [n for n in node.mod.graph.nodes
                     if n.op == "call_module" and n.target == rel]
            if calls:
                return node, rel, calls
        if node.parent is None:
            break
        rel = f"{node.name}.{rel}"
        node = node.parent
    return None


@register_primitive()
def decompose(sch) -> None:
    """Split this ``nn.Linear`` into its matmul and a bias add in the enclosing traced graph.

    The module becomes a ``DecomposedLinear`` computing ``F.linear(x, weight)``, and the graph
    that calls it adds ``bias`` right after the call, so that ``find`` can match the bias add
    together with what follows (bias + GeLU) and ``fuse`` it. Parameter names and objects do
    not change. The result is still schedulable: ``shard("weight", axis=0)`` shards the bias
    with it, and ``shard("weight", axis=1)`` with ``sync("fwd_post", "all_reduce")`` reduces
    the partial matmul before the graph adds the bias once. A column-parallel Linear
    (``shard`` of its weight and bias on axis 0, with its ``sync``s) may also be decomposed after
    sharding, as upstream's schedules do (shard, then fuse bias+GeLU): its hooks move to the
    decomposed module. A row-parallel one adds its bias after its sync, so decompose it before
    ``shard``, as a module that ``checkpoint`` or ``fork_rng`` changed.

    With no traced ancestor yet (upstream Slapo's order: decompose, then trace), the module
    becomes ``slapo.op.LinearWithSeparateBias`` (same parameters), whose forward adds the bias
    as an op of its own: ``trace(flatten=True)`` of an ancestor then records the matmul and
    the add in the graph, where ``find`` sees them.

    Example::

        ffn = sch["encoder.layer.0.intermediate"]
        ffn.trace()
        ffn["dense"].decompose()
        ffn.find(lambda x, bias: F.gelu(x + bias))
    """
    from ..op import LinearWithSeparateBias  # slapo.op imports the primitives' package
    from ..op._adopt import adopt

    where = sch.path or "<root>"
    mod = sch.mod
    if not isinstance(mod, nn.Linear) or isinstance(mod, (DecomposedLinear,
                                                          LinearWithSeparateBias)):
        raise TypeError(f"decompose applies to an nn.Linear; '{where}' is a "
                        f"{type(mod).__name__}")
    if mod.bias is None:
        raise ValueError(f"'{where}' (Linear) has no bias; there is nothing to decompose")
    if "forward" in mod.__dict__:
        raise ValueError(f"'{where}' has a forward replaced by an earlier primitive (a "
                         "row-parallel shard, which adds the bias after its sync; checkpoint; "
                         "fork_rng): decompose it before those primitives")
    if any(not is_inert_hook(hook) for hook in mod._forward_hooks.values()):
        raise ValueError(f"'{where}' has forward hooks (a fwd_post sync), which would run "
                         "before the bias that decompose moves out of the module: decompose it "
                         "before sync")
    owner = traced_owner(sch)
    if owner is None:
        if _inside_traced_graph(sch):
            raise ValueError(f"'{where}' is not called from a traced graph: "
                             f"{not_called_reason(sch)}")
        # Not traced yet (upstream's order: decompose, then trace): a Linear that adds its
        # bias as a second op, which a later trace(flatten=True) records in the graph (with
        # hooks, it stays a call there, and trace splits its bias out: split_hooked_biases).
        sch.replace(adopt(LinearWithSeparateBias, mod,
                          ("in_features", "out_features", "weight", "bias", "training")))
        return
    owner_sch, rel, _ = owner
    split_bias(owner_sch.mod, rel)
    sch.mod = getattr(sch.parent.mod, sch.name)
    sch._rebuild_children()


def split_bias(gm: fx.GraphModule, rel: str) -> None:
    """Make the Linear that ``gm`` calls at ``rel`` a ``DecomposedLinear`` (its hooks moved to
    it, run as before) and add its bias in ``gm``'s graph after each call."""
    mod = gm.get_submodule(rel)
    new = DecomposedLinear(mod)
    move_hooks(mod, new, keep=lambda hook: not is_inert_hook(hook))
    parent, _, name = rel.rpartition(".")
    setattr(gm.get_submodule(parent), name, new)
    for call in [n for n in gm.graph.nodes if n.op == "call_module" and n.target == rel]:
        with gm.graph.inserting_after(call):
            bias = gm.graph.get_attr(f"{rel}.decomposed_bias")
        with gm.graph.inserting_after(bias):
            add = gm.graph.call_function(operator.add, (call, bias))
        bias.meta[KIND] = add.meta[KIND] = "tensor"
        call.replace_all_uses_with(add, delete_user_cb=lambda user, add=add: user is not add)
    gm.graph.lint()
    gm.recompile()


def split_hooked_biases(gm: fx.GraphModule) -> None:
    """Decompose, in the graphs of ``gm``, the calls of a ``LinearWithSeparateBias`` that the
    tracer kept as a call because it has hooks (a column-parallel Linear decomposed after its
    ``sync``): its bias add joins the graph, as its forward's would have (``trace`` runs this)."""
    from ..op import LinearWithSeparateBias

    graphs = [sub for sub in gm.modules() if isinstance(sub, fx.GraphModule)]
    for sub in graphs:
        hooked = {path for path, mod in sub.named_modules()
                  if type(mod) is LinearWithSeparateBias and has_foreign_hooks(mod)}
        for path in sorted({n.target for n in sub.graph.nodes
                            if n.op == "call_module" and n.target in hooked}):
            split_bias(sub, path)
