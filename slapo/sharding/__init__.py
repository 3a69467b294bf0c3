"""Collectives with the autograd rules that tensor parallelism needs, and resharding; the
collectives also under upstream Slapo's names (``reduce_forward_output``, ...)."""

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

__all__ = ["FORWARD_OPS", "RESHARD_SCHEMES", "all_gather_forward", "all_gather_forward_output",
           "all_reduce_backward", "all_reduce_forward", "all_to_all_forward",
           "apply_backward_op", "apply_forward_op", "backward_only", "first_rank",
           "gather_sharded", "reduce_backward_grad", "reduce_forward_output",
           "reduce_scatter_forward", "reduce_scatter_forward_output", "reshard",
           "scatter_forward", "scatter_forward_output", "shard_slice", "world_size"]


def __getattr__(name: str):
    if name == "Solver":  # upstream's automatic sharding, asked for by name
        raise ImportError("slapo has no automatic sharding (upstream Slapo's "
                          "slapo.sharding.Solver and its cost model): shard the layers with "
                          "sch[...].shard(...) and sch[...].sync(...), as the schedules in "
                          "slapo.model_schedule do")
    raise AttributeError(f"module 'slapo.sharding' has no attribute '{name}'")
