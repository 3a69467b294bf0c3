"""replace: swap a module for another module or a function."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from . import register_primitive
from ._params import annotations


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
def replace(sch, new: nn.Module | Callable, subgraph=None, name: str | None = None) -> None:
    """Replace this node's module with ``new`` (a module, or a function wrapped in one).

    The schedule tree is updated in place: this node now schedules ``new`` and its children
    are ``new``'s children, ready to be scheduled further. Annotations of parameters carry
    over to the parameters of ``new`` that have the same name.

    Example::

        sch["encoder.layer.0.attention.self"].replace(MyFusedAttention(config))

    With ``subgraph`` (one result of ``find`` on this traced node, or a connected list of its
    nodes), only that subgraph is replaced: ``new`` is registered as submodule ``name``
    (default: its class name in snake case) and called on the subgraph's inputs, in the order
    of the pattern's arguments (for a plain list of nodes: in order of first use); it returns
    the subgraph's outputs (a tuple when there are several). A list of subgraphs (several
    matches) is replaced by one call side by side (horizontal fusion): ``new`` takes each
    match's inputs in turn, each value once, and returns each match's outputs in turn::

        q, k, v = (attn.find(name)[0] for name in ("query", "key", "value"))
        attn.replace(FusedQKV(...), subgraph=[[q], [k], [v]], name="qkv")

    One match::

        core = attn.find(attention_core_pattern)[0]   # inputs q, k, v, mask
        attn.replace(lambda q, k, v, mask: F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask), subgraph=core, name="sdpa")
    """
    if not isinstance(new, nn.Module):
        if not callable(new):
            raise TypeError(f"replace expects a module or a callable, got {type(new).__name__}")
        new = FunctionModule(new)
    if subgraph is not None:
        from ._subgraph import replace_subgraph
        replace_subgraph(sch, new, subgraph, name)
        return
    old_params = dict(sch.mod.named_parameters())
    for name, param in new.named_parameters():
        old = old_params.get(name)
        if old is not None and old is not param and getattr(old, "slapo_annotations", None):
            annotations(param).update(old.slapo_annotations)
    if sch.parent is not None:
        setattr(sch.parent.mod, sch.name, new)
    sch.mod = new
    sch._rebuild_children()
