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
    ``bias_gelu_0``), and its class is named ``name`` (``FusedModule`` by default), as
    upstream's. ``compiler``:

    - a backend name from ``torch._dynamo.list_backends()`` (``"inductor"``, the default,
      generates C++/OpenMP code on CPU, Triton on GPU) or a backend function: a
      ``FusedModule`` that compiles at its first call;
    - ``"TorchScript"`` (upstream Slapo's choice): the ``torch.jit.script`` of the extracted
      graph itself, a ``ScriptModule``, compiled at once;
    - None: no compilation; a subgraph of module calls one after another becomes, as
      upstream's, an ``nn.Sequential`` of those modules (``fused[0]`` is the first), any
      other a ``FusedModule`` running the extracted graph.

    Parameter names do not change. Nodes found before the fuse are stale afterwards; call
    ``find`` again.

    Example::

        ffn = sch["encoder.layer.0.intermediate"]
        ffn.trace()
        ffn["dense"].decompose()
        ffn.fuse(ffn.find(lambda x, bias: F.gelu(x + bias))[0], name="bias_gelu")
    """
    check_compiler(compiler)
    owner, sub = resolve(sch, subgraph)
    cls_name = name or FusedModule.__name__
    inner = extract_graph_module(owner.mod, sub, class_name=cls_name)
    chain = _module_chain(owner.mod, sub) if compiler is None else None
    if compiler == TORCHSCRIPT:
        fused = torch.jit.script(inner)
    elif chain is not None:
        fused = type(cls_name, (nn.Sequential,), {"__module__": __name__})(*chain)
    else:
        fused = type(cls_name, (FusedModule,), {"__module__": __name__})(inner, compiler)
    splice(owner.mod, sub, unique_name(owner.mod, cls_name), fused, node_inputs(sub))
    owner._rebuild_children()
    return fused


def _module_chain(gm: torch.fx.GraphModule, sub) -> list[nn.Module] | None:
    """The modules ``sub`` calls, if it is a chain of module calls on one input, each taking
    the previous one's output alone (what an ``nn.Sequential`` computes); else None."""
    previous = None
    for node in sub:
        if node.op != "call_module" or node.kwargs or len(node.args) != 1 or \
                (previous is not None and node.args[0] is not previous) or \
                (previous is None and node.args[0] in sub):
            return None
        previous = node
    return [gm.get_submodule(node.target) for node in sub]
