"""fuse: extract a subgraph of a traced module into one (compiled) submodule."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .. import state
from ..subgraph import extract_graph_module, node_inputs, splice, unique_name
from . import register_primitive
from ._subgraph import resolve


@state.leaf_class
class FusedModule(nn.Module):
    """A subgraph as one module: ``graph_module`` computes it, compiled with
    ``torch.compile(backend=compiler)`` unless ``compiler`` is None. Stays a leaf when the
    enclosing module is traced again."""

    def __init__(self, graph_module: torch.fx.GraphModule, compiler: str | Callable | None):
        super().__init__()
        self.graph_module = graph_module
        self.compiler = compiler
        if compiler is None:
            compiled = graph_module
        elif compiler == TORCHSCRIPT:
            compiled = torch.jit.script(graph_module)
        else:
            compiled = torch.compile(graph_module, backend=compiler)
        self.__dict__["_run"] = compiled  # not a registered child: parameters stay single

    def forward(self, *args):
        return self.__dict__["_run"](*args)

    def extra_repr(self) -> str:
        name = getattr(self.compiler, "__name__", self.compiler)
        return f"compiler={name!r}"


TORCHSCRIPT = "TorchScript"  # upstream Slapo's compiler: torch.jit.script of the subgraph


def check_compiler(compiler) -> None:
    """A ValueError for a compiler that ``torch.compile`` does not know (or TorchScript)."""
    if compiler is None or callable(compiler) or compiler == TORCHSCRIPT:
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
    """Replace ``subgraph`` of a traced graph by one submodule that computes it, compiled
    with ``torch.compile(backend=compiler)``, and return that submodule.

    ``subgraph`` is any form ``find`` returns (one match, a ``(path, node)``, a list of them
    fused side by side) or nodes; the graph is the one holding it, this node's or one below
    (a match's ``path``). The subgraph must be connected (each one, for a list) and convex
    (no path leaves it and re-enters). Its inputs (in the order of the pattern's arguments
    for a match) become the arguments of the new submodule, its outputs its results. The
    submodule is registered on the graph module holding the subgraph as upstream names it,
    ``<name>_<i>`` (``FusedModule_0``, ``FusedModule_1``, ... by default; ``name="bias_gelu"``:
    ``bias_gelu_0``, its graph's class ``bias_gelu``). ``compiler``: a backend name from
    ``torch._dynamo.list_backends()`` (``"inductor"`` generates C++/OpenMP code on CPU,
    Triton on GPU), a backend function, ``"TorchScript"`` (upstream Slapo's choice:
    ``torch.jit.script`` of the extracted graph, at once), or None to keep the extracted graph
    uncompiled. ``torch.compile`` compiles at the first call. Parameter names do not change.
    Nodes found before the fuse are stale afterwards; call ``find`` again.

    Example::

        ffn = sch["encoder.layer.0.intermediate"]
        ffn.trace()
        ffn["dense"].decompose()
        ffn.fuse(ffn.find(lambda x, bias: F.gelu(x + bias))[0], name="bias_gelu")
    """
    check_compiler(compiler)
    owner, sub = resolve(sch, subgraph)
    inner = extract_graph_module(owner.mod, sub, class_name=name or FusedModule.__name__)
    name = unique_name(owner.mod, name or FusedModule.__name__)
    fused = FusedModule(inner, compiler)
    splice(owner.mod, sub, name, fused, node_inputs(sub))
    owner._rebuild_children()
    return fused
