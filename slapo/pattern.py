"""The patterns of ``find`` (upstream Slapo's pattern language) and the search itself.

A pattern is one of:

- a regex string: the nodes whose name or target matches it (``re.search``);
- a predicate ``node -> bool``;
- a pattern function (``lambda x, bias: F.gelu(x + bias)``), a ``Pattern`` module, or an
  ``fx.Graph``: a subgraph, matched with torch.fx's ``SubgraphMatcher`` extended so that
  module calls match as upstream's do:

  - ``call_module(regex, *args)`` in a pattern function matches a call of any module whose
    target (its path in the graph) matches ``regex`` (``re.match``);
  - in a ``Pattern``, a ``ModulePattern(regex)`` submodule matches the same way, and any other
    submodule (``nn.Linear(1, 1)``) matches calls of a module of its class;
  - a functional in ``FUNCTIONAL_MODULES`` (``F.relu``, ``F.gelu``, ``F.linear`` ...) applied to
    one tensor also matches a call of the module class that computes it (``nn.ReLU``...),
    whatever that module's settings;
  - an argument of the pattern stands for any value at each of its uses, as upstream's
    matcher had it: ``F.relu(x) + x`` matches ``relu(conv(x)) + x`` (the two uses of ``x``
    match two values) as well as ``relu(x) + x``.

``find_in`` searches the graphs ``graphs_below`` lists and returns upstream's forms: a list of
``(path, node)`` for nodes, and for subgraphs a list of ``Match`` (a list of ``(path, node)``
that also knows the match's inputs and outputs). ``path`` is the path of the graph module that
holds the node, relative to the node ``find`` was called on ("" for its own graph).
"""

from __future__ import annotations

import copy
import inspect
import re
from collections.abc import Callable
from typing import NamedTuple

import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.fx.passes.utils.matcher_utils import SubgraphMatcher

from . import state

__all__ = ["FUNCTIONAL_MODULES", "Match", "ModulePattern", "Pattern", "call_module",
           "find_in", "graphs_below", "no_match_message"]


# --- the pattern language ----------------------------------------------------------------
class Pattern(nn.Module):
    """A subgraph pattern written as a module: ``forward`` is the pattern; submodules stand
    for module calls (a ``ModulePattern`` by path, any other module by its class)::

        class LinearReLU(slapo.Pattern):
            def __init__(self):
                super().__init__()
                self.fc = slapo.ModulePattern(r"fc\\d")
            def forward(self, x):
                return F.relu(self.fc(x))
    """

    def forward(self, *args):
        raise NotImplementedError(f"{type(self).__name__} must define forward: the pattern")


class ModulePattern(nn.Module):
    """In a ``Pattern``: a call of any module whose path in the graph matches ``name``, a
    regex (``re.match``, as upstream)."""

    def __init__(self, name: str):
        super().__init__()
        re.compile(name)  # a bad regex fails here, where it is written
        self.name = name

    def forward(self, *args):
        raise NotImplementedError("a ModulePattern stands for a module call in a Pattern; "
                                  "it is matched by find, never called")

    def extra_repr(self) -> str:
        return repr(self.name)


def call_module(name: str, *args):
    """In a pattern function: a call of any module whose path in the graph matches ``name``
    (a regex, ``re.match``) on ``args``::

        def qkv(x):
            return call_module(r"(query|key|value)", x).view(2, 8, 4, 8).permute(0, 2, 1, 3)
    """
    proxies = [a for a in args if isinstance(a, fx.Proxy)]
    if not proxies:
        raise RuntimeError("call_module stands for a module call in a pattern function; it "
                           "is traced by find, never called on values")
    return proxies[0].tracer.create_proxy("call_function", call_module, (name, *args), {})


# Functionals that a module class computes on its first argument (upstream's mapping, with
# the activations and dropout that transformers blocks use beside it).
FUNCTIONAL_MODULES: dict[Callable, type[nn.Module]] = {
    F.embedding: nn.Embedding, F.layer_norm: nn.LayerNorm, F.group_norm: nn.GroupNorm,
    F.linear: nn.Linear, F.conv1d: nn.Conv1d, F.conv2d: nn.Conv2d, F.relu: nn.ReLU,
    F.gelu: nn.GELU, F.silu: nn.SiLU, F.dropout: nn.Dropout, F.softmax: nn.Softmax,
    F.mse_loss: nn.MSELoss, F.cross_entropy: nn.CrossEntropyLoss,
}


class Match(list):
    """One match of a subgraph pattern, in upstream Slapo's form: ``(path, node)`` pairs in
    graph order. ``path`` is the path of the graph module holding the match (relative to the
    node ``find`` ran on), ``nodes`` the matched nodes, ``inputs`` the values the pattern's
    arguments matched (in the order of the arguments; an argument whose uses matched
    different values gives each, in the order of use), ``input_names`` the argument each
    input came from, ``outputs`` the nodes it returns (in its order)."""

    def __init__(self, path: str, nodes: list[fx.Node], inputs: list, outputs: list[fx.Node],
                 input_names: list[str] | None = None):
        super().__init__((path, n) for n in nodes)
        self.path = path
        self.nodes = list(nodes)
        self.inputs = inputs
        self.outputs = outputs
        self.input_names = input_names

    def __repr__(self) -> str:
        return f"Match(path={self.path!r}, nodes={[n.name for n in self.nodes]})"


# --- where find looks ------------------------------------------------------------------------
def graphs_below(sch) -> list[tuple[str, fx.GraphModule]]:
    """The graph modules of ``sch`` and of the nodes below it, in module order, with their
    paths relative to ``sch``; not those inside a fused module (its compiled graph is one
    call)."""
    found = []

    def walk(node, rel: str) -> None:
        if isinstance(node.mod, fx.GraphModule):
            found.append((rel, node.mod))
        if state.is_leaf(node.mod):
            return
        for name, child in node.child.items():
            walk(child, f"{rel}.{name}" if rel else name)

    walk(sch, "")
    return found


# --- find --------------------------------------------------------------------------------
def _label(node: fx.Node) -> str:
    if node.op == "call_function":
        return getattr(node.target, "__name__", str(node.target))
    return str(node.target)


def find_in(graphs: list[tuple[str, fx.GraphModule]], pattern, kind: str = "auto",
            ignore_literals: bool = True) -> list:
    """``(path, node)`` pairs (regex, predicate) or ``Match`` objects (subgraph patterns) in
    ``graphs``, graph by graph, each in graph order."""
    if kind not in ("auto", "regex", "predicate", "subgraph"):
        raise ValueError(f"unknown kind '{kind}'; expected auto, regex, predicate or subgraph")
    if isinstance(pattern, (str, re.Pattern)) and kind in ("auto", "regex"):
        try:
            regex = re.compile(pattern)
        except re.error as err:
            raise ValueError(f"find: {pattern!r} is no regular expression: {err}") from None
        return [(path, n) for path, n in _nodes(graphs)
                if regex.search(n.name) or regex.search(_label(n))]
    if isinstance(pattern, (fx.Graph, fx.GraphModule, Pattern)):
        kind = "subgraph"
    elif not callable(pattern):
        raise TypeError(f"find takes a regex string, a predicate node -> bool, a pattern "
                        f"function or a slapo.Pattern; got {type(pattern).__name__}")
    if kind == "auto":
        kind = "predicate" if _is_predicate(pattern, [n for _, n in _nodes(graphs)]) \
            else "subgraph"
    if kind == "predicate":
        return [(path, n) for path, n in _nodes(graphs) if pattern(n)]
    if kind == "regex":
        raise TypeError(f"kind='regex' needs a string pattern; got {type(pattern).__name__}")
    pattern_gm = _pattern_graph_module(pattern)
    return [m for path, gm in graphs for m in _match_subgraph(path, gm, pattern_gm,
                                                              ignore_literals)]


def _nodes(graphs):
    return [(path, n) for path, gm in graphs for n in gm.graph.nodes if n.op != "output"]


def _is_predicate(fn: Callable, nodes: list[fx.Node]) -> bool:
    if isinstance(fn, nn.Module):
        return False
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    if len(params) != 1 or not nodes:
        return False
    try:
        return isinstance(fn(nodes[0]), bool)
    except Exception:
        return False  # a pattern function fails on a Node: it computes on tensors


class _PatternTracer(fx.Tracer):
    """Traces a ``Pattern``: its submodules (other than nested Patterns) stay calls."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return not isinstance(m, Pattern)


def _pattern_graph_module(pattern) -> fx.GraphModule:
    """The pattern as a GraphModule (the module lets the matcher look up its submodules),
    with one placeholder per use of each argument."""
    if isinstance(pattern, fx.GraphModule):
        gm = pattern
    elif isinstance(pattern, fx.Graph):
        gm = fx.GraphModule(pattern.owning_module or nn.Module(), pattern)
    else:
        try:
            if isinstance(pattern, Pattern):
                gm = fx.GraphModule(pattern, _PatternTracer().trace(pattern))
            else:
                gm = fx.symbolic_trace(pattern)
        except Exception as err:
            raise ValueError(f"cannot trace the pattern {_name(pattern)}: {err}") from err
    unused = [n.target for n in gm.graph.nodes if n.op == "placeholder" and not n.users]
    if unused:
        raise ValueError(f"pattern {_name(pattern)} does not use its argument(s) "
                         f"{', '.join(unused)}")
    return _one_placeholder_per_use(gm)


_ARGUMENT = "slapo_pattern_argument"  # placeholder.meta key: the pattern argument it stands for


def _one_placeholder_per_use(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of the pattern whose arguments have one placeholder for each use, next to each
    other, so that each use matches a value of its own (upstream's matcher)."""
    gm = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    for ph in [n for n in gm.graph.nodes if n.op == "placeholder"]:
        ph.meta[_ARGUMENT] = ph.target
        anchor = ph
        for k, user in enumerate(list(ph.users)[1:], start=1):
            with gm.graph.inserting_after(anchor):
                anchor = gm.graph.placeholder(f"{ph.target}__use{k}")
            anchor.meta[_ARGUMENT] = ph.target
            user.replace_input_with(ph, anchor)
    gm.graph.lint()
    return gm


class _ModuleCall(NamedTuple):
    accepts: Callable[[nn.Module, str], bool]  # (graph's module, its target) -> match?
    args: tuple                                 # the pattern's arguments of the call


class _Matcher(SubgraphMatcher):
    """``SubgraphMatcher`` with upstream's module-call rules (see the module docstring)."""

    def __init__(self, pattern_gm: fx.GraphModule, ignore_literals: bool):
        super().__init__(pattern_gm.graph, match_output=False, match_placeholder=False,
                         remove_overlapping_matches=True, ignore_literals=ignore_literals)
        self.pattern_gm = pattern_gm

    def _module_call(self, pn: fx.Node) -> _ModuleCall | None:
        """How the pattern node ``pn`` matches a module call, or None if it does not."""
        if pn.op == "call_function" and pn.target is call_module:
            regex = re.compile(pn.args[0])
            return _ModuleCall(lambda mod, target: regex.match(target) is not None,
                               tuple(pn.args[1:]))
        if pn.op == "call_function" and pn.target in FUNCTIONAL_MODULES and \
                not any(isinstance(a, fx.Node) for a in pn.args[1:]):
            cls = FUNCTIONAL_MODULES[pn.target]
            return _ModuleCall(lambda mod, target: isinstance(mod, cls), tuple(pn.args[:1]))
        if pn.op == "call_module":
            sub = self.pattern_gm.get_submodule(pn.target)
            if isinstance(sub, ModulePattern):
                regex = re.compile(sub.name)
                return _ModuleCall(lambda mod, target: regex.match(target) is not None,
                                   tuple(pn.args))
            return _ModuleCall(lambda mod, target: type(mod) is type(sub), tuple(pn.args))
        return None

    def _call_of(self, pn: fx.Node, gn: fx.Node) -> _ModuleCall | None:
        if gn.op != "call_module":
            return None
        return self._module_call(pn)

    @staticmethod
    def _accepted(call: _ModuleCall, gn: fx.Node) -> bool:
        mod = gn.graph.owning_module.get_submodule(gn.target)
        return bool(call.accepts(mod, gn.target))

    def _nodes_are_equal(self, pn: fx.Node, gn: fx.Node, node_name_match: str = "") -> bool:
        call = self._call_of(pn, gn)
        if call is None:
            return super()._nodes_are_equal(pn, gn, node_name_match)
        return self._accepted(call, gn)

    def _match_nodes(self, pn: fx.Node, gn: fx.Node, match, node_name_match: str = "") -> bool:
        if pn.op == "placeholder":  # one use of a pattern argument: any value, even one
            if pn in match.nodes_map:  # that another use or argument matched
                return match.nodes_map[pn] == gn
            match.nodes_map[pn] = gn
            return True
        call = self._call_of(pn, gn)
        if call is None:
            return super()._match_nodes(pn, gn, match, node_name_match)
        if pn in match.nodes_map:
            return match.nodes_map[pn] == gn
        if gn in match.nodes_map.values() or gn.kwargs or len(call.args) != len(gn.args) \
                or not self._accepted(call, gn):
            return False
        saved = copy.copy(match.nodes_map)
        match.nodes_map[pn] = gn
        for pa, ga in zip(call.args, gn.args):
            if isinstance(pa, fx.Node) and isinstance(ga, fx.Node):
                ok = self._match_nodes(pa, ga, match)
            elif isinstance(ga, fx.Node):
                ok = False
            else:
                ok = self._match_literals(pa, ga, match) or self.ignore_literals
            if not ok:
                match.nodes_map.clear()
                match.nodes_map.update(saved)
                return False
        return True


def _match_subgraph(path: str, gm: fx.GraphModule, pattern_gm: fx.GraphModule,
                    ignore_literals: bool) -> list[Match]:
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    found = []
    placeholders = [n for n in pattern_gm.graph.nodes if n.op == "placeholder"]
    for match in _Matcher(pattern_gm, ignore_literals).match(gm.graph):
        compute = [gn for pn, gn in match.nodes_map.items()
                   if pn.op not in ("placeholder", "output")]
        compute.sort(key=order.__getitem__)
        inputs, names = [], []
        for ph in placeholders:  # each argument's values once, in the order of its uses
            name, value = ph.meta.get(_ARGUMENT, ph.target), match.nodes_map[ph]
            if not any(n == name and v is value for n, v in zip(names, inputs)):
                inputs.append(value)
                names.append(name)
        found.append(Match(path, compute, inputs, list(match.returning_nodes), names))
    found.sort(key=lambda m: order[m.nodes[0]])
    return found


def _name(fn) -> str:
    if isinstance(fn, nn.Module):
        return type(fn).__name__
    return getattr(fn, "__qualname__", None) or repr(fn)


def no_match_message(graphs: list[tuple[str, fx.GraphModule]], pattern, where: str) -> str:
    ops = []
    for _, n in _nodes(graphs):
        if n.op not in ("placeholder", "get_attr") and _label(n) not in ops:
            ops.append(_label(n))
    shown = ", ".join(ops[:25]) + (" ..." if len(ops) > 25 else "")
    what = repr(pattern.pattern if isinstance(pattern, re.Pattern) else pattern) \
        if isinstance(pattern, (str, re.Pattern)) else _name(pattern)
    size = sum(len(gm.graph.nodes) for _, gm in graphs)
    return (f"pattern {what} matches nothing in '{where}' ({size} nodes in {len(graphs)} "
            f"graph(s); operations: {shown}). A pattern function matches only if each of its "
            "intermediate values is used inside the match")

