"""Autograd-aware collectives for tensor parallelism (Megatron-LM's f/g operators).

Each forward collective has the backward that makes a replicated loss correct: the adjoint
of a forward all-reduce is the identity, of a reduce-scatter an all-gather, of a scatter
(keep this rank's slice) an all-gather, of an all-to-all the inverse all-to-all. The
adjoint of an all-gather depends on what consumes the gathered tensor
(``tensor_parallel_output_grad``, as upstream Slapo and Megatron-LM): a sharded computation
leaves each rank a partial gradient of the whole tensor, so the backward reduce-scatters; a
replicated one leaves every rank the same gradient, so the backward keeps this rank's
slice. ``all_reduce_backward`` is the identity in the forward and an all-reduce of the
gradient in the backward (the input side of a column-parallel layer).
All of them work on gloo (CPU) and NCCL (CUDA); with world size 1 they are identities.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def world_size(group=None) -> int:
    """Ranks in ``group`` (1 when torch.distributed is not initialised)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def first_rank(group=None) -> int:
    """The global rank of ``group``'s first member (the source of its broadcasts)."""
    return dist.get_global_rank(group, 0) if group is not None else 0


def broadcast_from_first(values: list, group=None) -> list:
    """``values`` as ``group``'s first rank has them: each tensor broadcast in place, except a
    view that is not contiguous (an expanded arange), broadcast as a contiguous copy, which
    takes its place (gloo and NCCL take contiguous tensors); other values stay."""
    if world_size(group) == 1:
        return list(values)
    src = first_rank(group)
    received = []
    for value in values:
        if isinstance(value, torch.Tensor):
            value = value.contiguous()
            dist.broadcast(value, src=src, group=group)
        received.append(value)
    return received


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


def _all_to_all(x: torch.Tensor, split_axis: int, cat_axis: int, group) -> torch.Tensor:
    """Chunk ``j`` of ``x`` along ``split_axis`` goes to rank ``j``; the chunks received are
    concatenated along ``cat_axis`` in rank order."""
    world = world_size(group)
    if world == 1:
        return x
    sends = [c.contiguous() for c in x.chunk(world, dim=split_axis)]
    receives = [torch.empty_like(sends[0]) for _ in range(world)]
    try:
        dist.all_to_all(receives, sends, group=group)
    except RuntimeError as err:
        # gloo before torch 2.13 has no all-to-all (it refuses before sending anything):
        # every rank gathers the whole tensors and keeps its chunk of each, p times the traffic.
        if "does not support alltoall" not in str(err):
            raise
        wholes = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(wholes, x.contiguous(), group=group)
        rank = dist.get_rank(group)
        receives = [whole.chunk(world, dim=split_axis)[rank] for whole in wholes]
    return torch.cat(receives, dim=cat_axis)


def check_divisible(x: torch.Tensor, axis: int, group, what: str) -> None:
    """Raise a ValueError unless ``x``'s axis ``axis`` splits evenly over ``group``."""
    world = world_size(group)
    if x.shape[axis] % world:
        raise ValueError(f"{what}: axis {axis} of a tensor of shape {tuple(x.shape)} has "
                         f"{x.shape[axis]} elements, not divisible by {world} ranks")


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
    def forward(ctx, x, axis, group, tensor_parallel_output_grad):
        ctx.axis, ctx.group = axis, group
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return _all_gather(x, axis, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.tensor_parallel_output_grad:  # each rank holds a partial gradient: sum them
            return _reduce_scatter(grad, ctx.axis, ctx.group), None, None, None
        return shard_slice(grad, ctx.axis, ctx.group), None, None, None


class _ScatterForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, group):
        ctx.axis, ctx.group = axis, group
        return shard_slice(x, axis, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.axis, ctx.group), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, split_axis, cat_axis, group):
        ctx.split_axis, ctx.cat_axis, ctx.group = split_axis, cat_axis, group
        return _all_to_all(x, split_axis, cat_axis, group)

    @staticmethod
    def backward(ctx, grad):
        # a permutation of the elements among ranks: its adjoint is the inverse permutation
        return _all_to_all(grad, ctx.cat_axis, ctx.split_axis, ctx.group), None, None, None


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


def backward_only(x, fn):
    """Identity in the forward; ``fn(gradient)`` in the backward (same shape)."""
    return _BackwardOnly.apply(x, fn)


def all_reduce_forward(x, group=None):
    """Sum over ranks in the forward; identity in the backward."""
    return _AllReduceForward.apply(x, group)


def all_reduce_backward(x, group=None):
    """Identity in the forward; sum of the gradient over ranks in the backward."""
    return _AllReduceBackward.apply(x, group)


def all_gather_forward(x, axis=-1, group=None, tensor_parallel_output_grad=True):
    """Concatenate the ranks' tensors along ``axis``. The backward reduce-scatters the
    gradient when the gathered tensor feeds a sharded computation
    (``tensor_parallel_output_grad=True``, upstream Slapo's default: Megatron-LM's sequence
    parallelism before a column-parallel layer), and keeps this rank's slice of it when it
    feeds a replicated one (``False``: for example full logits and a loss on every rank)."""
    return _AllGatherForward.apply(x, axis, group, tensor_parallel_output_grad)


def scatter_forward(x, axis=0, group=None):
    """Keep this rank's slice of a replicated ``x`` along ``axis``; the backward all-gathers
    the slices' gradients into the gradient of the whole tensor."""
    check_divisible(x, axis, group, "scatter")
    return _ScatterForward.apply(x, axis, group)


def all_to_all_forward(x, split_axis, cat_axis, group=None):
    """Re-shard ``x`` from ``cat_axis`` to ``split_axis``: send chunk ``j`` along
    ``split_axis`` to rank ``j`` and concatenate what arrives along ``cat_axis``. The backward
    is the inverse all-to-all."""
    check_divisible(x, split_axis, group, "all-to-all")
    return _AllToAll.apply(x, split_axis, cat_axis, group)


def reduce_scatter_forward(x, axis=0, group=None):
    """Sum over ranks and keep this rank's slice along ``axis``; the backward all-gathers."""
    check_divisible(x, axis, group, "reduce-scatter")
    return _ReduceScatterForward.apply(x, axis, group)


def gather_sharded(x: torch.Tensor, axis: int, group=None) -> torch.Tensor:
    """The full tensor from every rank's slice along ``axis`` (no autograd), for example to
    compare or save a sharded parameter or its gradient."""
    return _all_gather(x.detach(), axis, group)
