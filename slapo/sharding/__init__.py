"""Collectives with the autograd rules that tensor parallelism needs, and resharding."""

from .collectives import (
    all_gather_forward,
    all_reduce_backward,
    all_reduce_forward,
    all_to_all_forward,
    backward_only,
    first_rank,
    gather_sharded,
    reduce_scatter_forward,
    scatter_forward,
    shard_slice,
    world_size,
)
from .reshard import RESHARD_SCHEMES, reshard
from .sync_ops import FORWARD_OPS, apply_backward_op, apply_forward_op

__all__ = ["FORWARD_OPS", "RESHARD_SCHEMES", "all_gather_forward", "all_reduce_backward",
           "all_reduce_forward", "all_to_all_forward", "apply_backward_op", "apply_forward_op",
           "backward_only", "first_rank", "gather_sharded", "reduce_scatter_forward",
           "reshard", "scatter_forward", "shard_slice", "world_size"]
