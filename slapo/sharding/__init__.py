"""Collectives with the autograd rules that tensor parallelism needs."""

from .collectives import (
                          all_gather_forward,
                          all_reduce_backward,
                          all_reduce_forward,
                          apply_backward_op,
                          apply_forward_op,
                          first_rank,
                          gather_sharded,
                          reduce_scatter_forward,
                          shard_slice,
                          world_size,
)

__all__ = ["all_gather_forward", "all_reduce_backward", "all_reduce_forward",
           "apply_backward_op", "apply_forward_op", "first_rank", "gather_sharded",
           "reduce_scatter_forward", "shard_slice", "world_size"]
