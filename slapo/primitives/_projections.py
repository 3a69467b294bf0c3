"""Projections that read the same input, as one matrix product: the graph rewrite behind
``compile(fuse_projections=True)``.

In a Dynamo graph (torch-level, before autograd), the linears that read one input node
(attention's query, key and value; a gated MLP's gate and up projections) become one
``F.linear`` over their weights concatenated by rows, whose output is split back along its
last dimension. The parameters stay where they are: the concatenation is part of the graph,
so its backward hands each parameter its own slice of the gradient, and Inductor fuses the
concatenation with autocast's cast of the weights. One wide product replaces several narrow
ones in the forward, and in the backward one product gives the input's gradient (which
several would compute and then add) and one the weights'.
"""

from __future__ import annotations

import functools
import operator

import torch
import torch.fx
import torch.nn.functional as F

# every group fused in this process, as the module paths of its linears (one entry per
# graph compiled), for the records
_FUSED: list[tuple[str, ...]] = []


def fused_groups() -> list[tuple[str, ...]]:
    """The groups of projections fused so far in this process."""
    return list(_FUSED)


def _module_path(node: torch.fx.Node) -> str:
    """The path of the module whose call made ``node`` (Dynamo's ``nn_module_stack``), from
    the compiled module: ``attention.self.query``; the node's name where there is none."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return node.name
    path = list(stack.values())[-1][0]  # e.g. "L['self'].attention.self.query"
    return path.split("].", 1)[1] if "]." in path else path


# ``x += y`` in a Dynamo graph: a call of the operator module's in-place function
_IN_PLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv,
                       operator.ifloordiv, operator.imod, operator.ipow, operator.imatmul,
                       operator.iand, operator.ior, operator.ixor, operator.ilshift,
                       operator.irshift}


def _mutated(node: torch.fx.Node) -> bool:
    """Whether a user of ``node`` writes to it in place (``add_``, ``+=``): a slice of a split
    output cannot be, so such a linear stays alone."""
    for user in node.users:
        if user.target in _IN_PLACE_OPERATORS:
            return True
        name = user.target if isinstance(user.target, str) else getattr(user.target, "__name__", "")
        if name.endswith("_") and not name.endswith("__"):
            return True
    return False


def _linear_operands(node: torch.fx.Node):
    """(input, weight, bias) of an ``F.linear`` call node whose weight and bias are graph
    inputs (parameters) of known shape; None for any other node."""
    if node.op != "call_function" or node.target is not F.linear:
        return None
    args = list(node.args) + [None] * (3 - len(node.args))
    x, weight, bias = args[0], node.kwargs.get("weight", args[1]), node.kwargs.get("bias", args[2])
    for operand in (weight, bias):
        if operand is None:
            continue
        if not isinstance(operand, torch.fx.Node) or operand.op not in ("placeholder", "get_attr"):
            return None
        if not isinstance(operand.meta.get("example_value"), torch.Tensor):
            return None
    if weight is None or not isinstance(x, torch.fx.Node):
        return None
    return x, weight, bias


def fuse_projections(gm: torch.fx.GraphModule) -> list[tuple[str, ...]]:
    """Rewrite ``gm`` (a Dynamo graph) in place: each group of two or more linears that read
    the same input, all with a bias or all without and with weights of one dtype, becomes one
    linear and a split. Returns the groups fused, as their linears' module paths."""
    groups: dict[tuple, list] = {}
    for node in gm.graph.nodes:
        operands = _linear_operands(node)
        if operands is None or _mutated(node):
            continue
        x, weight, bias = operands
        key = (x, bias is not None, weight.meta["example_value"].dtype)
        groups.setdefault(key, []).append((node, weight, bias))
    fused = []
    graph = gm.graph
    for (x, _, _), members in groups.items():
        if len(members) < 2:
            continue
        sizes = [weight.meta["example_value"].shape[0] for _, weight, _ in members]
        with graph.inserting_before(members[0][0]):
            weight = graph.call_function(torch.cat, ([w for _, w, _ in members],), {"dim": 0})
            bias = (None if members[0][2] is None else
                    graph.call_function(torch.cat, ([b for _, _, b in members],), {"dim": 0}))
            out = graph.call_function(F.linear, (x, weight, bias))
            parts = graph.call_function(torch.split, (out, sizes), {"dim": -1})
            for i, (node, _, _) in enumerate(members):
                node.replace_all_uses_with(graph.call_function(operator.getitem, (parts, i)))
        fused.append(tuple(_module_path(node) for node, _, _ in members))
        for node, _, _ in members:
            graph.erase_node(node)
    if fused:
        graph.lint()
        gm.recompile()
        _FUSED.extend(fused)
    return fused


@functools.cache  # one backend object for each: Dynamo recompiles a region for a new one
def fusing_backend(compile_graph):
    """A ``torch.compile`` backend: ``fuse_projections`` on the graph, then ``compile_graph``
    (a backend function) on it. The same object for the same ``compile_graph``, so that
    layers that share their code share their compiled graphs too."""

    def backend(gm: torch.fx.GraphModule, example_inputs):
        fuse_projections(gm)
        return compile_graph(gm, example_inputs)

    backend.__name__ = f"fuse_projections+{getattr(compile_graph, '__name__', 'backend')}"
    return backend


def describe(groups: list[tuple[str, ...]]) -> str:
    """One line for a record's notes: each distinct group once, its paths' common prefix
    written once (``attention.self.query+key+value``)."""
    names = []
    for group in dict.fromkeys(groups):
        prefix = group[0].rpartition(".")[0]
        if all(path.rpartition(".")[0] == prefix for path in group):
            names.append((f"{prefix}." if prefix else "") + "+".join(
                path.rpartition(".")[2] for path in group))
        else:
            names.append("+".join(group))
    return ("projections that read one input, one matrix product over their concatenated "
            "weights in each compiled region (compile fuse_projections): " + ", ".join(names))
