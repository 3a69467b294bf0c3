"""Modules under upstream Slapo's names, with its constructor arguments and parameter names,
so that its schedules find what they replace with (and then shard) where they expect it.

- ``LinearWithSeparateBias``: ``x @ W^T`` then ``+ bias`` as two ops (a bias to fuse later);
- ``LinearWithSyncFunc``: ``sync_fn(x @ W^T) + bias``, a row-parallel linear whose partial
  sums are reduced before the bias is added once (``shard("weight", axis=1)`` keeps this
  forward; give it ``sync_fn=slapo.sharding.all_reduce_forward``);
- ``FusedQKV``: one linear for queries, keys and values; returns ``[q, k, v]`` with this rank's
  heads (``num_heads // world_size``) of ``head_size`` each, the three interleaved per head
  feature in the weight's rows, as upstream laid them out (so that a shard of the weight along
  axis 0 keeps whole heads of all three);
- ``FusedMLP``: ``fc_in`` (no bias) -> ``act`` (bias + GeLU fused, ``act.bias``) ->
  ``fc_out`` -> dropout;
- ``ParallelCrossEntropy``: the per-token cross entropy of vocabulary-sharded logits
  (``vocab_parallel_cross_entropy`` with ``reduction="none"``);
- ``Print``: ``print(*args)`` when it runs, returning its first argument (a debugging call
  that stays a call in a traced graph: what was fixed at tracing, such as a formatted proxy,
  prints as it was then; shapes of its other arguments print as they are at run time).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .. import state
from .cross_entropy import vocab_parallel_cross_entropy
from .gelu import bias_gelu

_GELU = {"gelu": "none", "gelu_new": "tanh"}  # HF activation names -> F.gelu approximation


class LinearWithSeparateBias(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight) + self.bias


@state.row_parallel_forward_class  # a row-parallel shard keeps this forward
class LinearWithSyncFunc(nn.Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype=None, sync_fn: Callable[[torch.Tensor], torch.Tensor] | None = None):
        super().__init__(in_features, out_features, bias, device, dtype)
        self.sync_fn = sync_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.sync_fn is not None:
            y = self.sync_fn(y)
        return y if self.bias is None else y + self.bias


class FusedQKV(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, world_size: int = 1):
        super().__init__()
        if hidden_size % num_heads or num_heads % world_size:
            raise ValueError(f"FusedQKV: hidden size {hidden_size}, {num_heads} heads and "
                             f"{world_size} ranks do not divide")
        self.hidden_size, self.num_heads, self.world_size = hidden_size, num_heads, world_size
        self.head_size = hidden_size // num_heads
        self.fused_linear = nn.Linear(hidden_size, 3 * hidden_size)

    def forward(self, hidden_states: torch.Tensor) -> list[torch.Tensor]:
        qkv = self.fused_linear(hidden_states)
        qkv = qkv.view(*qkv.shape[:-1], self.num_heads // self.world_size, self.head_size, 3)
        return [part.squeeze(-1).contiguous() for part in qkv.split(1, dim=-1)]


class BiasGeLU(nn.Module):
    """``gelu(x + bias)`` fused (``slapo.op.bias_gelu``), holding the bias."""

    def __init__(self, size: int, approximate: str = "none", device=None, dtype=None):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(size, device=device, dtype=dtype))
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return bias_gelu(x, self.bias, self.approximate)


class FusedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, orig_act: str,
                 resid_pdrop: float, use_torchscript: bool = False):
        # use_torchscript: upstream scripted its bias+GeLU; BiasGeLU here is compiled by
        # slapo.op.bias_gelu's rule (torch.compile on CUDA), so the flag changes nothing
        super().__init__()
        if orig_act not in _GELU:
            raise NotImplementedError(f"FusedMLP: unsupported activation {orig_act!r}; "
                                      f"expected one of {sorted(_GELU)}")
        self.fc_in = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.act = BiasGeLU(intermediate_size, _GELU[orig_act])
        self.fc_out = nn.Linear(intermediate_size, hidden_size)
        self.dropout = nn.Dropout(resid_pdrop)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc_out(self.act(self.fc_in(hidden_states))))


class ParallelCrossEntropy(nn.Module):
    def __init__(self, group=None):
        super().__init__()
        self.group = group

    def forward(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(outputs, labels, self.group, reduction="none")


@state.leaf_class
class Print(nn.Module):
    def forward(self, x, *args):
        print(*args)
        return x
