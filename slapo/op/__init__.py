"""Library kernels for schedules: attention on SDPA, fused bias+GeLU, vocabulary-parallel
cross entropy. Schedules swap them in with ``replace`` (or the helpers of
``slapo.model_schedule.common``); they are plain functions and modules, usable on their own.

- ``attention`` / ``CoreAttention`` / ``hf_attention_forward``: ``sdpa.py``
- ``bias_gelu`` / ``LinearGeLU``: ``gelu.py``
- ``vocab_parallel_cross_entropy``: ``cross_entropy.py``
"""

from .cross_entropy import vocab_parallel_cross_entropy
from .gelu import LinearGeLU, bias_gelu, compiled_kernel_state, gelu_approximation
from .sdpa import (SLAPO_ATTENTION, CoreAttention, attention, hf_attention_forward, merge_masks,
                   register_hf_attention)

__all__ = ["SLAPO_ATTENTION", "CoreAttention", "LinearGeLU", "attention", "bias_gelu",
           "compiled_kernel_state", "gelu_approximation", "hf_attention_forward", "merge_masks",
           "register_hf_attention", "vocab_parallel_cross_entropy"]
