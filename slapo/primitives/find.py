"""find: look up nodes or subgraphs in a traced module's graph."""

from __future__ import annotations

from ..pattern import find_in, graph_module_of, no_match_message
from . import register_primitive


@register_primitive()
def find(sch, pattern, kind: str = "auto", ignore_literals: bool = True,
         allow_empty: bool = False) -> list:
    """Find nodes or subgraphs in this traced node's graph (call ``trace`` first).

    ``pattern`` is one of:

    - a regex string: the nodes whose name or target matches (``re.search``); targets are
      module paths for module calls, method names, function names (``"softmax"``, ``"gelu"``);
    - a predicate ``node -> bool``: the nodes for which it is true;
    - a pattern function (or an ``fx.Graph``): traced with torch.fx and matched with
      ``SubgraphMatcher``; returns a list of ``slapo.pattern.Subgraph`` (lists of the matched
      nodes in graph order, with ``.inputs`` in the order of the function's arguments and
      ``.outputs`` in the order it returns them). Constants such as a scale factor or a
      dropout rate match any value unless ``ignore_literals=False``. A match is kept only if
      each intermediate value is used inside it (the values it returns may be used anywhere).

    The search covers this node's own graph: with ``trace(flatten=False)`` each submodule's
    graph belongs to its own node (``sch["attention.self"].find(...)``).
    A one-argument function is a predicate if it returns a bool on a node, else a pattern;
    ``kind="regex" | "predicate" | "subgraph"`` forces the reading. A pattern that matches
    nothing raises ``ValueError`` listing the graph's operations (``allow_empty=True``
    returns ``[]`` instead).

    Example::

        ffn = sch["encoder.layer.0.intermediate"]
        ffn.trace()
        ffn["dense"].decompose()
        bias_gelu = ffn.find(lambda x, bias: F.gelu(x + bias))[0]
        ffn.fuse(bias_gelu, compiler="inductor", name="bias_gelu")
        softmaxes = sch["encoder.layer.0.attention"].find("softmax")
    """
    gm = graph_module_of(sch)
    found = find_in(gm, pattern, kind=kind, ignore_literals=ignore_literals)
    if not found and not allow_empty:
        raise ValueError(no_match_message(gm, pattern, sch.path or "<root>"))
    return found
