"""Resharding between layouts of the last two axes, upstream Slapo's ``"RS->SR"`` notation.

A layout names each of a tensor's last two axes, ``-2`` then ``-1``: ``R`` replicated (every
rank holds the whole axis) or ``S`` sharded (rank ``r`` holds the ``r``-th of equal slices).
For a ``(batch, seq, hidden)`` activation, ``RS`` is split along the hidden features (the
output of a column-parallel linear), ``SR`` along the sequence (sequence parallelism).

Each change of layout is one autograd collective, with its adjoint as the backward:

- ``RR->RS``, ``RR->SR``: keep this rank's slice (scatter); backward all-gather;
- ``RS->RR``, ``SR->RR``: all-gather; backward keep this rank's slice, since the replicated
  result is consumed alike on every rank;
- ``RS->SR``, ``SR->RS``: all-to-all (each rank sends the others their part, as much data as
  one slice); backward the inverse all-to-all;
- a layout to itself: the identity.
"""

from __future__ import annotations

import torch

from .collectives import all_gather_forward, all_to_all_forward, scatter_forward

LAYOUTS = ("RR", "RS", "SR")
RESHARD_SCHEMES = tuple(f"{src}->{dst}" for src in LAYOUTS for dst in LAYOUTS)


def is_reshard_scheme(op) -> bool:
    """Whether ``op`` names a resharding, ``"<layout>-><layout>"`` (RR, RS or SR each)."""
    return isinstance(op, str) and op in RESHARD_SCHEMES


def _sharded_axis(layout: str) -> int | None:
    """The axis a layout shards (-2 or -1), or None for RR."""
    return {"RR": None, "SR": -2, "RS": -1}[layout]


def reshard(x: torch.Tensor, scheme: str, group=None) -> torch.Tensor:
    """Move ``x`` from the layout before ``->`` to the one after it (see the module doc)."""
    if scheme not in RESHARD_SCHEMES:
        raise ValueError(f"unknown resharding scheme '{scheme}'; expected one of "
                         f"{', '.join(RESHARD_SCHEMES)} (SS, sharded on both axes, is not "
                         "supported)")
    if x.dim() < 2:
        raise ValueError(f"resharding '{scheme}' needs a tensor of at least 2 axes, got shape "
                         f"{tuple(x.shape)}")
    src, dst = (_sharded_axis(layout) for layout in scheme.split("->"))
    if src == dst:
        return x
    if src is None:
        return scatter_forward(x, dst, group)
    if dst is None:
        return all_gather_forward(x, src, group, tensor_parallel_output_grad=False)
    return all_to_all_forward(x, split_axis=dst, cat_axis=src, group=group)
