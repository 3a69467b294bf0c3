"""compile: one ``torch.compile`` region over a whole submodule (regional compilation)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch._dynamo

from .. import state
from . import register_primitive
from ._projections import fusing_backend
from .fuse import check_compiler

# Entries per code object (see the docstring): T5's TP schedule on 2 ranks went past 8 for
# transformers' deprecate_kwarg wrapper alone.
RECOMPILE_LIMIT = 64


@register_primitive("compile")
def compile_region(sch, backend: str | Callable = "inductor", mode: str | None = None,
                   dynamic: bool | None = None, fullgraph: bool = False,
                   options: dict | None = None, fuse_projections: bool = False) -> None:
    """Compile this module's forward with ``torch.compile``: one region, traced at its first
    call, in which Inductor fuses the memory-bound work between the matrix products (norms
    with their residual add and dropout, rotary embeddings, gated activations,
    bias+activation) and keeps the matrix products on cuBLAS. Compiling each transformer
    layer rather than the whole model compiles one layer's code once (the layers share it)
    and keeps the parts of the model that other primitives manage outside.

    The module, its parameters and the schedule tree stay as they are, so other primitives
    still apply to it and to its children afterwards (compilation happens at the first call
    and sees them); ``checkpoint`` of this module must come after ``compile``, so that the
    recomputation wraps the compiled forward. What slapo adds that must run outside a graph
    runs eagerly between the compiled pieces, each a graph break: the collectives of ``sync``
    (and its ``overlap``), the random streams of ``fork_rng`` and the recomputation of a
    checkpointed child (whose forward is compiled again as a region of its own). A region
    without them is one graph. A region that breaks compiles the frames after each break as
    frames of their own, and transformers' modules share code objects (the wrappers of
    ``deprecate_kwarg`` and of gradient checkpointing) whose compiled entries add up over layer
    kinds and sequence lengths: so ``compile`` raises Dynamo's recompile limit per code object
    to at least :data:`RECOMPILE_LIMIT` (from 8; a region past the limit would run eagerly).
    Arguments are ``torch.compile``'s: ``backend`` (a name from
    ``torch._dynamo.list_backends()`` or a backend function), ``mode`` (e.g.
    ``"max-autotune"``), ``dynamic``, ``fullgraph`` (True: a graph break is an error) and
    ``options``. ``fuse_projections``: the linears of the region that read the same input
    (attention's query, key and value; a gated MLP's gate and up projections) run as one
    matrix product over their concatenated weights, the parameters unchanged
    (``slapo.primitives._projections``); with the backend's defaults only (no ``mode`` or
    ``options``). Compiling twice is a no-op. On CPU, Inductor generates C++ and each region
    costs seconds to compile; the family schedules compile on CUDA only.

    Example::

        for i in range(config.num_hidden_layers):
            sch[f"model.layers.{i}"].compile()
    """
    check_compiler(backend)
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
    mod = sch.mod
    if state.is_compiled(mod):
        return
    if state.is_checkpointed(mod):
        raise ValueError(f"compile '{sch.path or '<root>'}' before checkpointing it: "
                         "torch.compile cannot trace checkpoint's replay of random state, "
                         "while checkpoint recomputes a compiled forward as it is")
    if fuse_projections:
        if mode is not None or options:
            raise ValueError(f"compile '{sch.path or '<root>'}': fuse_projections compiles with "
                             "the backend's defaults; it takes no mode or options")
        backend = fusing_backend(torch._dynamo.lookup_backend(backend)
                                 if isinstance(backend, str) else backend)
    mod.forward = torch.compile(mod.forward, backend=backend, mode=mode, dynamic=dynamic,
                                fullgraph=fullgraph, options=options)
    state.mark_compiled(mod)
