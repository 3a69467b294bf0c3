"""The ``subgraph`` argument of ``fuse``, ``replace`` and ``checkpoint``: every form ``find``
returns, read in one place (``resolve``), and the subgraph forms of ``replace`` and
``checkpoint``.

The forms, as upstream Slapo reads them where it has them:

- one ``Match`` (a pattern match): that subgraph;
- a ``(path, node)`` pair, a node, or a list of nodes: that subgraph (a list: connected);
- a list of ``(path, node)`` pairs (a regex or predicate result): each node on its own, side
  by side (one pair: that node);
- a list of matches, of lists of pairs or of lists of nodes: side by side (horizontal
  fusion; a list of one: that one).

The graph is the one that holds the nodes: the node the primitive is called on or one below
it (a match's ``path`` says which, relative to that node).
"""

from __future__ import annotations

from collections.abc import Callable

import torch.fx as fx
from torch import nn

from ..pattern import Match
from ..subgraph import Subgraph, as_subgraph, extract_graph_module, node_inputs, splice, unique_name


def _is_pair(x) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) \
        and isinstance(x[1], fx.Node)


def _strip_paths(x, paths: set[str]):
    """``x`` in node form (what ``as_subgraph`` reads), the paths it names added to
    ``paths``."""
    if isinstance(x, Match):
        paths.add(x.path)
        return Subgraph(x.nodes, x.inputs, x.outputs)
    if _is_pair(x):
        paths.add(x[0])
        return [x[1]]
    if isinstance(x, (list, tuple)) and not isinstance(x, Subgraph) and \
            any(isinstance(e, (list, tuple)) for e in x):  # pairs or subgraphs: parts
        parts = [_strip_paths(e, paths) for e in x]
        return parts[0] if len(parts) == 1 else parts
    return x  # a node, a Subgraph, a list of nodes


def _first_node(x):
    if isinstance(x, fx.Node):
        return x
    if isinstance(x, (list, tuple)):
        for e in x:
            found = _first_node(e)
            if found is not None:
                return found
    return None


def resolve(sch, subgraph):
    """The schedule node whose graph holds ``subgraph``, and ``subgraph`` checked as one
    ``Subgraph`` of that graph (several given together: side by side)."""
    where = sch.path or "<root>"
    paths: set[str] = set()
    nodes_form = _strip_paths(subgraph, paths)
    first = _first_node(nodes_form)
    if first is None:
        raise ValueError(f"expected a subgraph (a result of find, or nodes of a traced graph) "
                         f"in '{where}', got {subgraph!r}")
    owner = next((node for _, node in sch.named_schedules()
                  if isinstance(node.mod, fx.GraphModule) and node.mod.graph is first.graph),
                 None)
    if owner is None:
        raise ValueError(f"node '{first.name}' is not in a graph of '{where}' or below it "
                         "(nodes found before a later fuse/replace/trace are stale: find "
                         "them again)")
    rel = owner.path[len(sch.path):].lstrip(".")
    if paths - {rel}:
        raise ValueError(f"the subgraph names the graph(s) {sorted(paths)} below '{where}', "
                         f"but its nodes are in the graph at '{rel}'")
    return owner, as_subgraph(owner.mod, nodes_form, owner.path or "<root>")


def replace_subgraph(sch, new: nn.Module, subgraph, name: str | None,
                     exact_name: bool = False) -> None:
    """Replace ``subgraph`` by a call of ``new`` on its inputs (all of them, constants a
    pattern argument matched included, in order), registered on the graph module holding it
    as upstream names it: ``<name>_<i>`` (``name`` by default the class name), or ``name``
    itself with ``exact_name``."""
    owner, sub = resolve(sch, subgraph)
    if not exact_name:
        name = unique_name(owner.mod, name or type(new).__name__)
    splice(owner.mod, sub, name, new, list(sub.inputs))
    owner._rebuild_children()


# The class name of the submodule checkpoint(subgraph=...) makes: upstream's wrapper's name,
# so that the default names (CheckPointWrapper_0, ...) are upstream's too.
CHECKPOINT_CLASS = "CheckPointWrapper"


def checkpoint_subgraph(sch, subgraph, name: str | None, checkpoint: Callable) -> None:
    """Extract ``subgraph`` into a submodule and checkpoint it."""
    owner, sub = resolve(sch, subgraph)
    name = unique_name(owner.mod, name or CHECKPOINT_CLASS)
    inner = extract_graph_module(owner.mod, sub, class_name=CHECKPOINT_CLASS)
    splice(owner.mod, sub, name, inner, node_inputs(sub))
    owner._rebuild_children()
    checkpoint(owner[name])
