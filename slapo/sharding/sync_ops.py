"""The sync ops by name, as ``sync`` takes them: collectives and resharding schemes."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .collectives import (
    all_gather_forward,
    all_reduce_backward,
    all_reduce_forward,
    backward_only,
    reduce_scatter_forward,
    scatter_forward,
)
from .reshard import is_reshard_scheme, reshard

FORWARD_OPS = ("all_reduce", "all_gather", "reduce_scatter", "scatter")


def is_forward_op(op) -> bool:
    """Whether ``op`` names a forward sync op (a collective or a resharding scheme)."""
    return op in FORWARD_OPS or is_reshard_scheme(op)


def describe_forward_ops() -> str:
    return f"{', '.join(FORWARD_OPS)}, a resharding '<layout>-><layout>' (RR, RS or SR: axis -2 " \
           "then -1, R replicated, S sharded; SS is not supported)"


def apply_forward_op(op: str | Callable, x: torch.Tensor, group=None, axis: int = 0,
                     tensor_parallel_output_grad: bool = True) -> torch.Tensor:
    """Apply a named forward op (with its adjoint backward) or a callable to ``x``.

    ``axis`` applies to all_gather, reduce_scatter and scatter; ``tensor_parallel_output_grad``
    to all_gather (``slapo.sharding.all_gather_forward``).
    """
    if callable(op):
        return op(x)
    if op == "all_reduce":
        return all_reduce_forward(x, group)
    if op == "all_gather":
        return all_gather_forward(x, axis, group, tensor_parallel_output_grad)
    if op == "reduce_scatter":
        return reduce_scatter_forward(x, axis, group)
    if op == "scatter":
        return scatter_forward(x, axis, group)
    if is_reshard_scheme(op):
        return reshard(x, op, group)
    raise ValueError(f"unknown sync op '{op}'; expected one of {describe_forward_ops()}, or "
                     "a callable")


def apply_backward_op(op: str | Callable, x: torch.Tensor, group=None) -> torch.Tensor:
    """Identity on ``x`` whose gradient is all-reduced over ``group`` or passed to a callable.

    Only shape-preserving operations are allowed on a gradient, so the other forward ops are
    refused here.
    """
    if op == "all_reduce":
        return all_reduce_backward(x, group)
    if callable(op):
        return backward_only(x, op)
    if is_forward_op(op):
        raise ValueError(f"sync op '{op}' changes the gradient's shape; a backward sync takes "
                         "'all_reduce' or a callable")
    raise ValueError(f"unknown sync op '{op}'; expected one of {describe_forward_ops()}, or "
                     "a callable")


# --- upstream Slapo's names of the collectives (``slapo.sharding.sync_ops.<name>``) ---------
def all_gather_forward_output(x: torch.Tensor, dim: int, group=None,
                              tensor_parallel_output_grad: bool = True) -> torch.Tensor:
    """All-gather along ``dim``; backward as ``sync``'s ``tensor_parallel_output_grad``."""
    return all_gather_forward(x, dim, group, tensor_parallel_output_grad)


def reduce_scatter_forward_output(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """Reduce-scatter along ``dim``; backward all-gathers."""
    return reduce_scatter_forward(x, dim, group)


def scatter_forward_output(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """This rank's slice along ``dim``; backward all-gathers."""
    return scatter_forward(x, dim, group)


def reduce_forward_output(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-reduce in the forward; identity in the backward."""
    return all_reduce_forward(x, group)


def reduce_backward_grad(x: torch.Tensor, group=None) -> torch.Tensor:
    """Identity in the forward; all-reduce of the gradient in the backward."""
    return all_reduce_backward(x, group)
