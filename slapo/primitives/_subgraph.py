"""Subgraph forms of ``replace`` and ``checkpoint`` (the ``subgraph=`` argument)."""

from __future__ import annotations

import re
from collections.abc import Callable

from torch import nn

from ..pattern import (
    as_subgraph,
    extract_graph_module,
    fresh_name,
    graph_module_of,
    node_inputs,
    splice,
)


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def replace_subgraph(sch, new: nn.Module, subgraph, name: str | None) -> None:
    """Replace ``subgraph`` of the traced node ``sch`` by a call of ``new`` on its inputs
    (all of them, constants a pattern argument matched included, in order)."""
    gm = graph_module_of(sch)
    sub = as_subgraph(gm, subgraph, sch.path or "<root>")
    name = name or fresh_name(gm, _snake(type(new).__name__))
    splice(gm, sub, name, new, list(sub.inputs))
    sch._rebuild_children()


def checkpoint_subgraph(sch, subgraph, name: str | None, checkpoint: Callable) -> None:
    """Extract ``subgraph`` of the traced node ``sch`` into a submodule and checkpoint it."""
    gm = graph_module_of(sch)
    sub = as_subgraph(gm, subgraph, sch.path or "<root>")
    name = name or fresh_name(gm, "checkpointed")
    inner = extract_graph_module(gm, sub, class_name=name)
    splice(gm, sub, name, inner, node_inputs(sub))
    sch._rebuild_children()
    checkpoint(sch[name])
