"""Collectives with the autograd rules that tensor parallelism needs."""

from .collectives import (
                          all_gather_forward,
                          all_reduce_backward,
                          all_reduce_forward,
                          apply_backward_op,
                          apply_forward_op,
                          gather_sharded,
                          reduce_scatter_forward,
                          shard_slice,
)

__all__ = ["all_gather_forward", "all_reduce_backward", "all_reduce_forward",
           "apply_backward_op", "apply_forward_op", "gather_sharded",
           "reduce_scatter_forward", "shard_slice"]
