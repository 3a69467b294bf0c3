"""replace: swap a module for another module or a function."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ..hooks import move_hooks
from ..pattern import Match
from ..tracing import is_inert_hook
from . import register_primitive
from ._params import set_annotation
from .base import keyword_aliases


class FunctionModule(nn.Module):
    """Wraps a plain function so that it can stand where a module stood."""

    def __init__(self, fn: Callable):
        super().__init__()
        self.fn = fn

    def forward(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def extra_repr(self) -> str:
        return getattr(self.fn, "__qualname__", repr(self.fn))


@register_primitive()
@keyword_aliases(new_mod_or_func="new", target_ops="subgraph")  # upstream's names
def replace(sch, new: nn.Module | Callable, subgraph=None, name: str | None = None,
            concrete_args: dict | None = None) -> None:
    """Replace this node's module with ``new`` (a module, or a function wrapped in one).

    The schedule tree is updated in place: this node now schedules ``new`` and its children
    are ``new``'s children, ready to be scheduled further. The old module's hooks (registered
    with torch, or by ``sync``) move to ``new``, as upstream Slapo moved them, and
    annotations of parameters carry over to the parameters of ``new`` that have the same
    name. ``new`` takes the replaced module's training mode (``train``/``eval``; with
    ``subgraph``, that of the graph it joins), as the model's ``eval()`` would have set it.

    Example::

        sch["encoder.layer.0.attention.self"].replace(MyFusedAttention(config))

    With ``subgraph`` (any form ``find`` returns: one match, a ``(path, node)``, a list of
    them; or nodes of a traced graph), only that subgraph is replaced, in the graph that
    holds it (this node's or one below: a match's ``path``), by one call of ``new``: a
    module is registered on that graph module as upstream names it, ``<name>_<i>`` (``name``
    by default the class name: ``FusedQKV_0``; ``name="qkv"``: ``qkv_0``), a function is
    called as itself (a ``call_function`` node named after it). The call returns the
    subgraph's outputs (a tuple when there are several) and takes

    - a function for one ``(path, node)`` (a ``find_node`` result): the node's own
      arguments, as written (``replace(new_view, view_node)`` calls ``new_view(x, shape)``);
    - for a match: the values its pattern's arguments matched, each to the parameter of
      ``new`` of the same name when they are named alike, else in the order of the
      arguments (an argument whose uses matched different values gives each, in the order
      of use; upstream ordered every input by first use in the graph, so a replacement
      written for that order gets its inputs right here when its parameters carry the
      pattern's names);
    - for nodes: their inputs from outside, in order of first use;
    - for several matches side by side (horizontal fusion): each match's inputs in turn,
      each value once, returning each match's outputs in turn.

    ``concrete_args`` are passed as keywords besides (arguments of ``new`` that the
    subgraph has no value for); a ``new`` that cannot take the call's arguments is an error
    that says so. The hooks of the module calls replaced go to ``new``: the first call's
    forward pre-hooks and backward hooks, the last call's forward hooks (any other hook is
    an error, as upstream's). ::

        attn.replace(FusedQKV(...), subgraph=attn.find(r"^(query|key|value)$"), name="qkv")

    One match::

        core = attn.find(attention_core_pattern)[0]   # inputs q, k, v, mask
        attn.replace(lambda q, k, v, mask: F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask), subgraph=core, name="sdpa")
    """
    if not isinstance(new, nn.Module) and not callable(new):
        raise TypeError(f"replace expects a module or a callable, got {type(new).__name__}")
    if subgraph is not None:
        from ._subgraph import replace_subgraph
        replace_subgraph(sch, new, subgraph, name, concrete_args=concrete_args)
        return
    if concrete_args:
        raise ValueError(f"replace of '{sch.path or '<root>'}': concrete_args applies to the "
                         "replacement of a subgraph")
    if not isinstance(new, nn.Module):
        new = FunctionModule(new)
    old_params = dict(sch.mod.named_parameters())
    for pname, param in new.named_parameters():
        old = old_params.get(pname)
        if old is not None and old is not param and getattr(old, "slapo_annotations", None):
            for key, value in old.slapo_annotations.items():
                set_annotation(param, key, value)
    if new is not sch.mod:
        move_hooks(sch.mod, new, keep=lambda hook: not is_inert_hook(hook))
        new.train(sch.mod.training)  # a new module is in training mode; the model may not be
    if sch.parent is not None:
        setattr(sch.parent.mod, sch.name, new)
    sch.mod = new
    sch._rebuild_children()


@register_primitive()
@keyword_aliases(target_mod_type="target")  # upstream's name
def replace_all(sch, target, make_mod_fn: Callable, **kwargs) -> list[str]:
    """Replace every module of class ``target`` at or below this node, or every match of the
    pattern ``target``, by what ``make_mod_fn`` makes (upstream Slapo's ``replace_all``).

    - ``target`` a module class (or a tuple of them): each such module is replaced as by
      ``replace`` with ``make_mod_fn(path, module, **kwargs)``, ``path`` relative to this
      node. Modules inside one that was replaced are left alone (they went with it).
    - ``target`` any pattern ``find`` takes: each match (in this node's graph and the traced
      graphs below it) is replaced as by ``replace(new, subgraph=match)`` with
      ``new = make_mod_fn(path, match, **kwargs)``: a module, registered under upstream's
      default name (numbered in graph order), or a function, called as itself. Matches are
      replaced last to first, so that a match that feeds a later one stays valid.

    - ``target`` a regex string: each node it finds is replaced on its own, with
      ``make_mod_fn(path, (path, node), **kwargs)``.

    Returns the paths replaced (for a pattern: of the graphs, once per match)::

        sch.replace_all(nn.Dropout, lambda path, mod: slapo.op.Dropout(mod.p))
        sch.replace_all(lambda x, bias: F.gelu(x + bias), lambda path, match: MyBiasGeLU())
    """
    if isinstance(make_mod_fn, type):
        raise TypeError(f"replace_all(target, make_mod_fn): make_mod_fn is the class "
                        f"{make_mod_fn.__name__}; pass the target first and a function "
                        "(path, module or match) -> new module second")
    if not callable(make_mod_fn):
        raise TypeError(f"replace_all: make_mod_fn must be callable, got "
                        f"{type(make_mod_fn).__name__}")
    classes = target if isinstance(target, tuple) else (target,)
    if all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        return _replace_modules(sch, classes, make_mod_fn, kwargs)
    found = sch.find(target, allow_empty=False)  # Match objects, or (path, node) pairs
    paths = [f.path if isinstance(f, Match) else f[0] for f in found]
    news = [make_mod_fn(path, f, **kwargs) for path, f in zip(paths, found)]
    names = _names_in_graph_order(sch, paths, news)  # a function: called as itself, no name
    names = [name if isinstance(new, nn.Module) else None for name, new in zip(names, news)]
    from ._subgraph import replace_subgraph
    for f, new, name in reversed(list(zip(found, news, names))):
        replace_subgraph(sch, new, f, name, exact_name=True)
    return paths


def _names_in_graph_order(sch, paths: list[str], news: list) -> list[str]:
    """Upstream's default names (``<class name>_<i>``), numbered in graph order although the
    matches are replaced last to first."""
    taken: set[tuple[str, str]] = set()
    names = []
    for path, new in zip(paths, news):
        gm = sch[path].mod
        base = type(new).__name__
        i = 0
        while hasattr(gm, f"{base}_{i}") or (path, f"{base}_{i}") in taken:
            i += 1
        taken.add((path, f"{base}_{i}"))
        names.append(f"{base}_{i}")
    return names


def _replace_modules(sch, classes: tuple, make_mod_fn: Callable, kwargs: dict) -> list[str]:
    replaced: list[str] = []
    for path, node in list(sch.named_schedules()):
        rel = path[len(sch.path):].lstrip(".")
        if any(r == "" or rel == r or rel.startswith(f"{r}.") for r in replaced):
            continue  # inside a module already replaced
        if isinstance(node.mod, classes):
            replace(node, make_mod_fn(rel, node.mod, **kwargs))
            replaced.append(rel)
    if not replaced:
        names = ", ".join(c.__name__ for c in classes)
        raise ValueError(f"replace_all: no {names} at or below '{sch.path or '<root>'}'")
    return replaced
