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

import inspect
from collections.abc import Callable

import torch.fx as fx
from torch import nn

from ..hooks import move_hooks
from ..pattern import Match
from ..subgraph import Subgraph, as_subgraph, extract_graph_module, node_inputs, splice, unique_name
from ..tracing import is_inert_hook
from ..utils.common import get_hooks


def _is_pair(x) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) \
        and isinstance(x[1], fx.Node)


def _strip_paths(x, paths: set[str]):
    """``x`` in node form (what ``as_subgraph`` reads), the paths it names added to
    ``paths``."""
    if isinstance(x, Match):
        paths.add(x.path)
        return Subgraph(x.nodes, x.inputs, x.outputs, x.input_names)
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


def replace_subgraph(sch, new, subgraph, name: str | None, exact_name: bool = False,
                     concrete_args: dict | None = None) -> None:
    """Replace ``subgraph`` by one call of ``new`` (a module, registered on the graph module
    holding the subgraph as upstream names it, ``<name>_<i>`` with ``name`` by default the
    class name, or ``name`` itself with ``exact_name``; or a function, called as itself).

    A function replacing one node (a ``(path, node)`` pair or a node) is called with the
    node's own arguments, as written (upstream's rule; keywords it does not take that hold
    the replaced function's default are left out). Any other call takes the subgraph's
    inputs (constants a pattern argument matched included): matched to ``new``'s parameters
    by name when they are named like the pattern's arguments, else in the order of the
    arguments.
    ``concrete_args`` are passed as keywords besides. The hooks of the module calls replaced
    go to ``new``: the first call's forward pre-hooks and backward hooks, the last call's
    forward hooks; any other hook (or any hook, for several subgraphs side by side or a
    function) is an error."""
    owner, sub = resolve(sch, subgraph)
    where = owner.path or "<root>"
    is_module = isinstance(new, nn.Module)
    single = None if is_module else _single_node(subgraph)
    if single is not None:
        args, kwargs = list(single.args), _informative_kwargs(single, new)
    else:
        args, kwargs = list(sub.inputs), {}
    kwargs.update(concrete_args or {})
    if is_module and not exact_name:
        name = unique_name(owner.mod, name or type(new).__name__)
    args, kwargs = _bind(new, args, kwargs, sub.input_names if single is None else None,
                         where)
    hooked = _hooked_calls(owner.mod, sub, new, where)
    if is_module:
        new.train(owner.mod.training)  # the mode of the graph it joins
    splice(owner.mod, sub, name, new, args, kwargs)
    for module, kinds in hooked:
        move_hooks(module, new, kinds, keep=lambda hook: not is_inert_hook(hook))
    owner._rebuild_children()


def _informative_kwargs(node: fx.Node, new) -> dict:
    """The node's keyword arguments, less those ``new`` does not take that hold the replaced
    function's default (``F.relu``'s ``inplace=False``): they change nothing."""
    kwargs = dict(node.kwargs)
    try:
        taken = inspect.signature(new).parameters
        old = inspect.signature(node.target).parameters if callable(node.target) else {}
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind == p.VAR_KEYWORD for p in taken.values()):
        return kwargs
    return {k: v for k, v in kwargs.items()
            if k in taken or k not in old or old[k].default is inspect.Parameter.empty or
            old[k].default != v}


def _single_node(subgraph) -> fx.Node | None:
    if isinstance(subgraph, fx.Node):
        return subgraph
    return subgraph[1] if _is_pair(subgraph) else None


def _bind(new, args: list, kwargs: dict, names: list[str] | None, where: str):
    """The arguments of the new call: positional, or by name when the pattern's argument
    names are ``new``'s parameter names; checked against ``new``'s signature, so that a
    replacement that takes other arguments is an error here, not at the first forward."""
    fn = new.forward if isinstance(new, nn.Module) else new
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return args, kwargs  # a builtin: nothing to check against
    params = signature.parameters
    if names and len(set(names)) == len(names) == len(args) and \
            all(n in params and params[n].kind == params[n].POSITIONAL_OR_KEYWORD and
                n not in kwargs for n in names):
        leading = [n for n, p in params.items() if p.kind == p.POSITIONAL_OR_KEYWORD]
        by_name = dict(zip(names, args))
        if set(leading[:len(names)]) == set(names):  # positional, in new's order (hooks
            args = [by_name[n] for n in leading[:len(names)]]  # see positional arguments)
        else:
            args, kwargs = [], {**by_name, **kwargs}
    try:
        signature.bind(*args, **kwargs)
    except TypeError as err:
        what = getattr(new, "__qualname__", type(new).__name__)
        raise ValueError(f"replace at '{where}': {what}{signature} cannot take the "
                         f"subgraph's {len(args)} input(s) and {sorted(kwargs)} ({err}); "
                         "give the arguments it takes besides with concrete_args={...}") \
            from None
    return args, kwargs


def _hooked_calls(gm: fx.GraphModule, sub: Subgraph, new, where: str):
    """The module calls of ``sub`` whose hooks go to ``new``, with the hook kinds that go; a
    hook that cannot go (it belongs in the middle of the new call) is an error."""
    moves = []
    first, last = sub[0], sub[-1]
    for node in sub:
        if node.op != "call_module":
            continue
        module = gm.get_submodule(node.target)
        hooks = {kind: hooks for kind, hooks in get_hooks(module).items() if hooks}
        if not hooks:
            continue
        allowed = set()
        if sub.parts is None and isinstance(new, nn.Module):
            allowed |= {"fwd_pre", "bwd_post"} if node is first else set()
            allowed |= {"fwd_post"} if node is last else set()
        stuck = sorted(set(hooks) - allowed)
        if stuck:
            reason = "several subgraphs side by side" if sub.parts is not None else \
                "a function" if not isinstance(new, nn.Module) else \
                "a call in which this module runs in the middle"
            raise ValueError(f"replace at '{where}': '{node.target}' has {', '.join(stuck)} "
                             f"hooks, which cannot run on {reason}; apply those hooks (or "
                             "syncs) to the new module after replacing")
        moves.append((module, tuple(hooks)))
    return moves


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
