"""Subgraphs of a traced graph, and splicing one out of its graph.

A *subgraph* is a list of nodes of one traced graph that is connected and convex (no path
leaves it and comes back), so that it can stand as one call. ``Subgraph`` knows its inputs
(values from outside, in the order of a pattern's arguments when ``find`` made it) and its
outputs (nodes used outside). ``fuse``, ``replace(subgraph=...)`` and
``checkpoint(subgraph=...)`` check a subgraph (``as_subgraph``; several side by side:
``horizontal``) and turn it into a call of a submodule (``splice``).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

import torch.fx as fx
from torch import nn

from .tracing import KIND

__all__ = ["Subgraph", "as_subgraph", "extract_graph_module", "horizontal", "node_inputs",
           "splice", "unique_name"]


class Subgraph(list):
    """Nodes of a subgraph in graph order, with ``inputs`` (values from outside: nodes, or
    constants a pattern argument matched), ``input_names`` (the pattern argument of each
    input, when a pattern made it), ``outputs`` (nodes used outside) and ``parts`` (the
    subgraphs a side-by-side union was made of; None for one subgraph)."""

    def __init__(self, nodes: Iterable[fx.Node], inputs: list | None = None,
                 outputs: list[fx.Node] | None = None, input_names: list[str] | None = None,
                 parts: list[Subgraph] | None = None):
        super().__init__(nodes)
        self.inputs = inputs
        self.outputs = outputs
        self.input_names = input_names
        self.parts = parts

    def __repr__(self) -> str:
        return f"Subgraph({[n.name for n in self]})"


def as_subgraph(gm: fx.GraphModule, subgraph, where: str) -> Subgraph:
    """Check that ``subgraph`` is one connected, convex set of nodes of ``gm``'s graph and
    return it as a ``Subgraph`` with inputs and outputs; or, given a list of such subgraphs
    (several matches of ``find``), their union as one (:func:`horizontal`)."""
    if isinstance(subgraph, fx.Node):
        subgraph = [subgraph]
    if not isinstance(subgraph, (list, tuple)) or not subgraph:
        raise ValueError(f"expected a subgraph (a non-empty list of nodes, e.g. one result of "
                         f"find) in '{where}', got {subgraph!r}")
    if all(isinstance(x, (list, tuple)) for x in subgraph):
        return horizontal(gm, subgraph, where)
    if any(isinstance(x, (list, tuple)) for x in subgraph):
        raise ValueError(f"expected a subgraph or a list of subgraphs in '{where}', got a mix "
                         "of nodes and lists of nodes")
    live = set(gm.graph.nodes)
    for n in subgraph:
        if not isinstance(n, fx.Node):
            raise TypeError(f"a subgraph holds fx.Node objects; got {type(n).__name__}")
        if n.graph is not gm.graph or n not in live:
            raise ValueError(f"node '{n.name}' is not in the graph of '{where}' (nodes found "
                             "before a later fuse/replace/trace are stale: find them again)")
        if n.op in ("placeholder", "output"):
            raise ValueError(f"a subgraph cannot hold the {n.op} node '{n.name}'")
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    nodes = sorted(set(subgraph), key=order.__getitem__)
    members = set(nodes)
    _check_connected(nodes, members, where)
    _check_convex(nodes, members, order, where)

    used_outside = [n for n in nodes if any(u not in members for u in n.users)]
    outputs = getattr(subgraph, "outputs", None)
    if outputs:
        missing = [n.name for n in used_outside if n not in outputs]
        if missing:
            raise ValueError(f"node(s) {', '.join(missing)} of the subgraph in '{where}' are "
                             "used outside it but are not among its outputs")
        outputs = list(outputs)
    else:
        outputs = used_outside
    if not outputs:
        raise ValueError(f"the subgraph {[n.name for n in nodes]} in '{where}' has no value "
                         "used outside it")
    external: list[fx.Node] = []
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in members and a not in external:
                external.append(a)
    inputs = getattr(subgraph, "inputs", None)
    if inputs is None:
        inputs = external
    missing = [a.name for a in external if a not in inputs]
    if missing:
        raise ValueError(f"the subgraph in '{where}' uses {', '.join(missing)} from outside "
                         "but not as one of its inputs")
    return Subgraph(nodes, list(inputs), outputs, getattr(subgraph, "input_names", None))


def horizontal(gm: fx.GraphModule, parts, where: str) -> Subgraph:
    """Several disjoint subgraphs as one (horizontal fusion: e.g. the Q, K and V projections
    of one input become one call). Its inputs are each part's inputs in turn, each node once
    and none that another part computes; its outputs each part's outputs in turn (those used
    outside the union). The union must still be convex: no value flows
    from one part to another through nodes outside them."""
    subs = [as_subgraph(gm, part, where) for part in parts]
    seen: set[fx.Node] = set()
    for sub in subs:
        if seen & set(sub):
            raise ValueError(f"the subgraphs given together in '{where}' overlap")
        seen |= set(sub)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    nodes = sorted(seen, key=order.__getitem__)
    _check_convex(nodes, seen, order, where)
    inputs: list = []
    for sub in subs:  # a value one part computes for another is no input of the union
        inputs += [a for a in sub.inputs
                   if not (isinstance(a, fx.Node) and (a in inputs or a in seen))]
    outputs = [o for sub in subs for o in sub.outputs if any(u not in seen for u in o.users)]
    return Subgraph(nodes, inputs, outputs, parts=subs)


def _check_connected(nodes, members, where) -> None:
    seen = {nodes[0]}
    todo = [nodes[0]]
    while todo:
        n = todo.pop()
        for m in list(n.all_input_nodes) + list(n.users):
            if m in members and m not in seen:
                seen.add(m)
                todo.append(m)
    if len(seen) != len(nodes):
        rest = [n.name for n in nodes if n not in seen]
        raise ValueError(f"the subgraph in '{where}' is not connected: "
                         f"{[n.name for n in nodes if n in seen]} and {rest} share no edge; "
                         "fuse or replace them separately, or side by side as a list of "
                         "subgraphs (e.g. [[n] for n in nodes])")


def _check_convex(nodes, members, order, where) -> None:
    last = order[nodes[-1]]
    frontier = [u for n in nodes for u in n.users if u not in members and order[u] < last]
    seen = set()
    while frontier:
        n = frontier.pop()
        if n in seen:
            continue
        seen.add(n)
        for u in n.users:
            if u in members:
                raise ValueError(f"the subgraph in '{where}' is not convex: '{n.name}' uses a "
                                 f"value of the subgraph and feeds its node '{u.name}', so "
                                 "the subgraph cannot become one call; add it to the subgraph")
            if order[u] < last:
                frontier.append(u)


def node_inputs(sub: Subgraph) -> list[fx.Node]:
    """The distinct node inputs of ``sub``, in order (constants left out)."""
    out: list[fx.Node] = []
    for value in sub.inputs:
        if isinstance(value, fx.Node) and value not in out:
            out.append(value)
    return out


def extract_graph_module(gm: fx.GraphModule, sub: Subgraph, class_name: str) -> fx.GraphModule:
    """A GraphModule computing ``sub``: its node inputs (``node_inputs``) as arguments, its
    outputs as the result (a tuple when there are several)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for value in node_inputs(sub):
        env[value] = graph.placeholder(value.name)
    for n in sub:
        env[n] = graph.node_copy(n, lambda a: env[a])
    outs = [env[o] for o in sub.outputs]
    graph.output(outs[0] if len(outs) == 1 else tuple(outs))
    graph.lint()
    return fx.GraphModule(gm, graph, class_name=class_name)


def splice(gm: fx.GraphModule, sub: Subgraph, name: str, new: nn.Module | Any,
           args: list[Any], kwargs: dict | None = None) -> fx.Node:
    """Replace the nodes of ``sub`` by one call of ``new`` on ``args`` (and ``kwargs``): a
    module, registered as ``name`` and called as a submodule, or a function, called as
    itself (a ``call_function`` node, as upstream Slapo puts a function in the graph, named
    ``name`` or, for None, after the function). The call returns the outputs (a tuple when
    there are several)."""
    is_module = isinstance(new, nn.Module)
    if is_module and hasattr(gm, name):
        raise ValueError(f"'{name}' is already an attribute of {type(gm).__name__}; choose "
                         "another name")
    if is_module:
        gm.add_submodule(name, new)
    graph = gm.graph
    members = set(sub)
    last = sub[-1]
    # Nodes between the first and the last subgraph node that depend on the subgraph move
    # after the new call, in their order (the subgraph is convex, so none feeds it).
    moved, inside, depends = [], False, set(members)
    for n in graph.nodes:
        if n is sub[0]:
            inside = True
        if n is last:
            break
        if inside and n not in members and any(a in depends for a in n.all_input_nodes):
            depends.add(n)
            moved.append(n)
    with graph.inserting_after(last):
        call = graph.call_module(name, tuple(args), kwargs or {}) if is_module else \
            graph.create_node("call_function", new, tuple(args), kwargs or {}, name=name)
    anchor = call
    if len(sub.outputs) == 1:
        call.meta[KIND] = sub.outputs[0].meta.get(KIND, "unknown")
        sub.outputs[0].replace_all_uses_with(call)
    else:
        call.meta[KIND] = "tuple"
        for i, out in enumerate(sub.outputs):
            with graph.inserting_after(anchor):
                item = graph.call_function(operator.getitem, (call, i))
            item.meta[KIND] = out.meta.get(KIND, "unknown")
            out.replace_all_uses_with(item)
            anchor = item
    for n in moved:
        anchor.append(n)
        anchor = n
    for n in reversed(sub):
        graph.erase_node(n)
    graph.lint()
    gm.recompile()
    return call


# GraphModule.meta key: the submodule names replace, fuse and checkpoint have tried on it.
_TAKEN = "slapo_taken_names"


def unique_name(gm: nn.Module, base: str) -> str:
    """``base_0``, or ``base_1``, ``base_2``, ... if taken: upstream Slapo's names for the
    submodules that ``replace``, ``fuse`` and ``checkpoint`` add to a graph. A name counts as
    taken once it was handed out, even to a replace that then failed (upstream left that
    module behind), so that the next one is numbered as upstream numbers it."""
    taken = getattr(gm, "meta", {}).get(_TAKEN, set())
    i = 0
    while hasattr(gm, f"{base}_{i}") or f"{base}_{i}" in taken:
        i += 1
    name = f"{base}_{i}"
    if isinstance(getattr(gm, "meta", None), dict):
        gm.meta.setdefault(_TAKEN, set()).add(name)
    return name
