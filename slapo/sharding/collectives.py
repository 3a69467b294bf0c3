"""Autograd-aware collectives for tensor parallelism (Megatron-LM's f/g operators).

Each forward collective has the backward that makes a replicated loss correct: the adjoint
of a forward all-reduce is the identity, of an all-gather the local slice, of a
reduce-scatter an all-gather. ``all_reduce_backward`` is the identity in the forward and an
all-reduce of the gradient in the backward (the input side of a column-parallel layer).
All of them work on gloo (CPU) and NCCL (CUDA); with world size 1 they are identities.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist


def world_size(group=None) -> int:
    """Ranks in ``group`` (1 when torch.distributed is not initialised)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def first_rank(group=None) -> int:
    """The global rank of ``group``'s first member (the source of its broadcasts)."""
    return dist.get_global_rank(group, 0) if group is not None else 0


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if world_size(group) == 1:
        return x
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


def _all_gather(x: torch.Tensor, axis: int, group) -> torch.Tensor:
    world = world_size(group)
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=axis)


def shard_slice(x: torch.Tensor, axis: int, group) -> torch.Tensor:
    """This rank's slice of ``x`` along ``axis`` (no communication)."""
    world = world_size(group)
    if world == 1:
        return x
    rank = dist.get_rank(group)
    return x.chunk(world, dim=axis)[rank].contiguous()


def _reduce_scatter(x: torch.Tensor, axis: int, group) -> torch.Tensor:
    if world_size(group) == 1:
        return x
    # gloo has no reduce-scatter: an all-reduce and a local slice give the same result.
    if dist.get_backend(group) == "gloo":
        return shard_slice(_all_reduce(x, group), axis, group)
    world = world_size(group)
    inputs = [c.contiguous() for c in x.chunk(world, dim=axis)]
    out = torch.empty_like(inputs[0])
    dist.reduce_scatter(out, inputs, group=group)
    return out


class _AllReduceForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _AllReduceBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _AllGatherForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, group):
        ctx.axis, ctx.group = axis, group
        return _all_gather(x, axis, group)

    @staticmethod
    def backward(ctx, grad):
        return shard_slice(grad, ctx.axis, ctx.group), None, None


class _ReduceScatterForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, group):
        ctx.axis, ctx.group = axis, group
        return _reduce_scatter(x, axis, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.axis, ctx.group), None, None


class _BackwardOnly(torch.autograd.Function):
    """Identity forward; ``fn`` applied to the gradient in the backward."""

    @staticmethod
    def forward(ctx, x, fn):
        ctx.fn = fn
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.fn(grad), None


def all_reduce_forward(x, group=None):
    """Sum over ranks in the forward; identity in the backward."""
    return _AllReduceForward.apply(x, group)


def all_reduce_backward(x, group=None):
    """Identity in the forward; sum of the gradient over ranks in the backward."""
    return _AllReduceBackward.apply(x, group)


def all_gather_forward(x, axis=-1, group=None):
    """Concatenate the ranks' tensors along ``axis``; the backward keeps this rank's slice."""
    return _AllGatherForward.apply(x, axis, group)


def reduce_scatter_forward(x, axis=0, group=None):
    """Sum over ranks and keep this rank's slice along ``axis``; the backward all-gathers."""
    return _ReduceScatterForward.apply(x, axis, group)


FORWARD_OPS = ("all_reduce", "all_gather", "reduce_scatter")


def apply_forward_op(op: str | Callable, x: torch.Tensor, group=None, axis: int | None = None):
    """Apply a named forward collective (with its adjoint backward) or a callable to ``x``."""
    if callable(op):
        return op(x)
    if op == "all_reduce":
        return all_reduce_forward(x, group)
    if op == "all_gather":
        return all_gather_forward(x, -1 if axis is None else axis, group)
    if op == "reduce_scatter":
        return reduce_scatter_forward(x, 0 if axis is None else axis, group)
    raise ValueError(f"unknown sync op '{op}'; expected one of {FORWARD_OPS} or a callable")


def apply_backward_op(op: str | Callable, x: torch.Tensor, group=None):
    """Identity on ``x`` whose gradient is all-reduced over ``group`` or passed to a callable.

    Only shape-preserving operations are allowed on a gradient, so all-gather and
    reduce-scatter are refused here.
    """
    if op == "all_reduce":
        return all_reduce_backward(x, group)
    if callable(op):
        return _BackwardOnly.apply(x, op)
    if op in FORWARD_OPS:
        raise ValueError(f"sync op '{op}' changes the gradient's shape; a backward sync takes "
                         "'all_reduce' or a callable")
    raise ValueError(f"unknown sync op '{op}'; expected one of {FORWARD_OPS} or a callable")


def gather_sharded(x: torch.Tensor, axis: int, group=None) -> torch.Tensor:
    """The full tensor from every rank's slice along ``axis`` (no autograd), for example to
    compare or save a sharded parameter or its gradient."""
    return _all_gather(x.detach(), axis, group)
