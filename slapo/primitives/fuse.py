"""fuse: extract a subgraph of a traced module into one (compiled) submodule."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .. import state
from ..pattern import (
    as_subgraph,
    extract_graph_module,
    fresh_name,
    graph_module_of,
    node_inputs,
    splice,
)
from . import register_primitive


@state.leaf_class
class FusedModule(nn.Module):
    """A subgraph as one module: ``graph_module`` computes it, compiled with
    ``torch.compile(backend=compiler)`` unless ``compiler`` is None. Stays a leaf when the
    enclosing module is traced again."""

    def __init__(self, graph_module: torch.fx.GraphModule, compiler: str | Callable | None):
        super().__init__()
        self.graph_module = graph_module
        self.compiler = compiler
        compiled = graph_module if compiler is None else \
            torch.compile(graph_module, backend=compiler)
        self.__dict__["_run"] = compiled  # not a registered child: parameters stay single

    def forward(self, *args):
        return self.__dict__["_run"](*args)

    def extra_repr(self) -> str:
        name = getattr(self.compiler, "__name__", self.compiler)
        return f"compiler={name!r}"


def check_compiler(compiler) -> None:
    """A ValueError for a compiler that ``torch.compile`` does not know."""
    if compiler is None or callable(compiler):
        return
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=())
    if compiler not in known:
        raise ValueError(f"unknown compiler {compiler!r}; torch.compile backends: "
                         f"{', '.join(torch._dynamo.list_backends())} (debug/experimental: "
                         f"{', '.join(sorted(set(known) - set(torch._dynamo.list_backends())))}"
                         "), a backend function, or None for no compilation")


@register_primitive()
def fuse(sch, subgraph, compiler: str | Callable | None = "inductor",
         name: str | None = None) -> nn.Module:
    """Replace ``subgraph`` (one result of ``find``, a list of nodes, or a list of such
    subgraphs fused side by side) of this traced node by one submodule that computes it,
    compiled with ``torch.compile(backend=compiler)``.

    The subgraph must be connected (each one, for a list) and convex (no path leaves it and
    re-enters). Its inputs
    (in the order of the pattern's arguments for a ``find`` match) become the arguments of
    the new submodule, registered as ``name`` (default ``fused``, ``fused_1``, ...) and
    returned; its outputs its results. ``compiler``: a backend name from
    ``torch._dynamo.list_backends()`` (``"inductor"`` generates C++/OpenMP code on CPU,
    Triton on GPU), a backend function, or None to keep the extracted graph uncompiled.
    Compilation happens at the first call. Parameter names do not change. Nodes found before
    the fuse are stale afterwards; call ``find`` again.

    Example::

        ffn = sch["encoder.layer.0.intermediate"]
        ffn.trace()
        ffn["dense"].decompose()
        ffn.fuse(ffn.find(lambda x, bias: F.gelu(x + bias))[0], name="bias_gelu")
    """
    check_compiler(compiler)
    gm = graph_module_of(sch)
    where = sch.path or "<root>"
    sub = as_subgraph(gm, subgraph, where)
    name = name or fresh_name(gm, "fused")
    inner = extract_graph_module(gm, sub, class_name=name)
    fused = FusedModule(inner, compiler)
    splice(gm, sub, name, fused, node_inputs(sub))
    sch._rebuild_children()
    return fused
