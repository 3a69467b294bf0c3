"""find: look up nodes or subgraphs in the traced graphs of a node and below it."""

from __future__ import annotations

import re

import torch.fx as fx

from ..pattern import find_in, graphs_below, no_match_message
from . import register_primitive


@register_primitive()
def find(sch, pattern, kind: str = "auto", ignore_literals: bool = True,
         allow_empty: bool = True) -> list:
    """Find nodes or subgraphs in this node's graph and in the traced graphs below it, as
    upstream Slapo does; this node is traced first (``trace()`` with its defaults) if it is
    not traced yet.

    Each result names where it is: ``path`` is the path of the graph module holding it,
    relative to this node ("" for this node's own graph), so that ``sch[path]`` is the node
    whose graph it is. ``pattern`` is one of (``slapo.pattern`` has the details):

    - a regex string: the nodes whose name or target matches (``re.search``); targets are
      module paths for module calls, method names, function names (``"softmax"``, ``"gelu"``).
      Returns ``[(path, node), ...]``;
    - a predicate ``node -> bool``: the nodes for which it is true, ``[(path, node), ...]``;
    - a pattern function, a ``slapo.Pattern`` module or an ``fx.Graph``: its matches, each a
      ``slapo.pattern.Match``, which is upstream's list of ``(path, node)`` and also carries
      ``.nodes``, ``.inputs`` (in the order of the pattern's arguments) and ``.outputs`` (in
      the order it returns them). ``call_module(regex, x)`` and ``ModulePattern(regex)``
      match module calls by path, other pattern submodules by class, and ``F.relu`` (and the
      other ``slapo.pattern.FUNCTIONAL_MODULES``) also matches an ``nn.ReLU`` call.
      Constants such as a scale factor or a dropout rate match any value unless
      ``ignore_literals=False``. A match is kept only if each intermediate value is used
      inside it (the values it returns may be used anywhere).

    Every result can be given to ``fuse``, ``replace`` and ``checkpoint``: one match or
    ``(path, node)``, or a list of them (side by side). A one-argument function is a
    predicate if it returns a bool on a node, else a pattern; ``kind="regex" | "predicate" |
    "subgraph"`` forces the reading. A pattern that matches nothing gives ``[]``, as upstream's
    did (its schedules loop over what they find); ``allow_empty=False`` raises ``ValueError``
    instead, listing the graphs' operations (the project's own schedules ask for that).

    Example::

        ffn = sch["encoder.layer.0.intermediate"]
        ffn.trace()
        ffn["dense"].decompose()
        bias_gelu = ffn.find(lambda x, bias: F.gelu(x + bias))[0]
        ffn.fuse(bias_gelu, compiler="inductor", name="bias_gelu")
        for path, node in sch["encoder.layer.0"].find("softmax"):
            print(path, node)          # attention.self softmax
    """
    if not isinstance(sch.mod, fx.GraphModule):
        sch.trace()
    graphs = graphs_below(sch)
    found = find_in(graphs, pattern, kind=kind, ignore_literals=ignore_literals)
    if not found and not allow_empty:
        raise ValueError(no_match_message(graphs, pattern, sch.path or "<root>"))
    return found


@register_primitive()
def find_node(sch, pattern, allow_empty: bool = True) -> list:
    """Upstream Slapo's ``find_node``: ``find`` of a regex string or a predicate
    ``node -> bool``; returns ``[(path, node), ...]``."""
    regex = isinstance(pattern, (str, re.Pattern))
    return find(sch, pattern, kind="regex" if regex else "predicate", allow_empty=allow_empty)


@register_primitive()
def find_subgraph(sch, pattern, ignore_literals: bool = True,
                  allow_empty: bool = True) -> list:
    """Upstream Slapo's ``find_subgraph``: ``find`` of a pattern function or a
    ``slapo.Pattern``; returns a list of ``slapo.pattern.Match``."""
    return find(sch, pattern, kind="subgraph", ignore_literals=ignore_literals,
                allow_empty=allow_empty)
