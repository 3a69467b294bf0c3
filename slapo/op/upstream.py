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
- ``LinearWithAct``, ``LinearWithDropout``: a ``LinearWithSyncFunc`` whose bias add is fused
  with the activation (GeLU) or with the dropout that follows;
- ``FusedMLP``: ``fc_in`` (a ``LinearWithAct``) -> ``fc_out`` (a ``LinearWithDropout``), as
  upstream's last version (an earlier one had ``fc_in`` without bias, then ``act.bias``);
- ``ParallelCrossEntropy``: the per-token cross entropy of vocabulary-sharded logits
  (``vocab_parallel_cross_entropy`` with ``reduction="none"``; defined in ``cross_entropy``,
  where upstream's scripts import it from);
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
from .cross_entropy import ParallelCrossEntropy  # noqa: F401 (importable here too)
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

    def synced_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W^T`` with ``sync_fn`` applied: what the bias (and what a subclass fuses
        with it) is added to."""
        y = F.linear(x, self.weight)
        return y if self.sync_fn is None else self.sync_fn(y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.synced_matmul(x)
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


class LinearWithAct(LinearWithSyncFunc):
    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 act_fn: str = "gelu", device=None, dtype=None,
                 sync_fn: Callable[[torch.Tensor], torch.Tensor] | None = None):
        if not bias:
            raise ValueError("LinearWithAct needs a bias (it fuses the bias add with the "
                             "activation); use nn.Linear without one")
        if act_fn not in _GELU:
            raise NotImplementedError(f"LinearWithAct: unsupported activation {act_fn!r}; "
                                      f"expected one of {sorted(_GELU)}")
        super().__init__(in_features, out_features, bias, device, dtype, sync_fn)
        self.act_fn = act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return bias_gelu(self.synced_matmul(x), self.bias, _GELU[self.act_fn])


class LinearWithDropout(LinearWithSyncFunc):
    def __init__(self, in_features: int, out_features: int, bias: bool = True, p: float = 0.5,
                 inplace: bool = False, device=None, dtype=None,
                 sync_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 use_torchscript: bool = False):
        # use_torchscript: upstream's choice of fuser for bias + dropout; one op here
        if not bias:
            raise ValueError("LinearWithDropout needs a bias (it fuses the bias add with the "
                             "dropout); use nn.Linear without one")
        super().__init__(in_features, out_features, bias, device, dtype, sync_fn)
        self.p, self.inplace, self.use_torchscript = p, inplace, use_torchscript

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.synced_matmul(x) + self.bias, self.p, self.training, self.inplace)


class FusedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, orig_act: str,
                 resid_pdrop: float, use_torchscript: bool = False):
        super().__init__()
        if orig_act not in _GELU:
            raise NotImplementedError(f"FusedMLP: unsupported activation {orig_act!r}; "
                                      f"expected one of {sorted(_GELU)}")
        self.fc_in = LinearWithAct(hidden_size, intermediate_size, act_fn=orig_act)
        self.fc_out = LinearWithDropout(intermediate_size, hidden_size, p=resid_pdrop,
                                        use_torchscript=use_torchscript)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.fc_out(self.fc_in(hidden_states))


@state.leaf_class
class Print(nn.Module):
    def forward(self, x, *args):
        print(*args)
        return x
