"""Collectives with the autograd rules that tensor parallelism needs, and resharding; the
collectives also under upstream Slapo's names (``reduce_forward_output``, ...); and ``Solver``,
upstream's automatic sharding (``solver``: it needs z3, imported only when it solves)."""

from .collectives import (
    all_gather_forward,
    all_reduce_backward,
    all_reduce_forward,
    all_to_all_forward,
    backward_only,
    broadcast_from_first,
    first_rank,
    gather_sharded,
    reduce_scatter_forward,
    scatter_forward,
    shard_slice,
    world_size,
)
from .reshard import RESHARD_SCHEMES, reshard
from .solver import Solver
from .sync_ops import (
    FORWARD_OPS,
    all_gather_forward_output,
    apply_backward_op,
    apply_forward_op,
    reduce_backward_grad,
    reduce_forward_output,
    reduce_scatter_forward_output,
    scatter_forward_output,
)

__all__ = ["FORWARD_OPS", "RESHARD_SCHEMES", "Solver", "all_gather_forward",
           "all_gather_forward_output", "all_reduce_backward", "all_reduce_forward",
           "all_to_all_forward", "apply_backward_op", "apply_forward_op", "backward_only",
           "broadcast_from_first", "first_rank", "gather_sharded", "reduce_backward_grad",
           "reduce_forward_output", "reduce_scatter_forward", "reduce_scatter_forward_output",
           "reshard",
           "scatter_forward", "scatter_forward_output", "shard_slice", "world_size"]

