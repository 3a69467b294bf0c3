"""shard: split parameters across the ranks of the schedule's group."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import state
from ..hooks import defer_bias
from . import register_primitive
from ._params import get_param


@dataclass(frozen=True)
class ShardSpec:
    """How a sharded parameter was split: its axis, the world size and the full shape."""
    axis: int
    world_size: int
    full_shape: tuple[int, ...]


def shard_spec(param: torch.Tensor) -> ShardSpec | None:
    """The ``ShardSpec`` of a parameter sharded by slapo, else None."""
    return getattr(param, "slapo_shard", None)


@register_primitive()
def shard(sch, param_names: str | list[str], axis: int) -> None:
    """Keep only this rank's slice of each parameter in ``param_names`` along ``axis``.

    The module is adjusted so that it computes its part of the result:

    - ``nn.Linear`` ``weight`` on axis 0 (column parallel): the bias is sharded with it and
      the output holds this rank's output features (gather or keep them sharded).
    - ``nn.Linear`` ``weight`` on axis 1 (row parallel): the output is a partial sum; the bias
      is added once, after the forward syncs (add ``sync("fwd_post", "all_reduce")``).
    - ``nn.Conv*d`` likewise with output/input channels.
    - ``nn.Embedding`` ``weight`` on axis 0 (vocabulary parallel): ids outside this rank's
      vocabulary range look up zeros, so the output is a partial sum to all-reduce.
    - ``nn.Embedding`` ``weight`` on axis 1: the output holds this rank's hidden features.

    Parameters tied to the sharded one (for example an LM head sharing the word-embedding
    weight) are replaced by the same new parameter, and their modules adjusted too, so tied
    weights stay tied. Annotations move to the new parameter. Sharding an already sharded
    parameter again along the same axis is a no-op.

    Raises ``ValueError`` when the axis size does not divide by the world size.

    Example::

        sch["encoder.layer.0.attention.self.query"].shard(["weight", "bias"], axis=0)
        sch["encoder.layer.0.attention.output.dense"].shard("weight", axis=1)
    """
    names = [param_names] if isinstance(param_names, str) else list(param_names)
    for name in names:
        _shard_one(sch, name, axis)


def _shard_one(sch, name: str, axis: int) -> None:
    _shard_param(sch, sch.mod, sch.path or "<root>", name, axis)


def _shard_param(sch, module: nn.Module, where: str, name: str, axis: int) -> None:
    param = module._parameters.get(name)
    if param is None:
        get_param(sch, name)  # raises the error that names the module's parameters
    where = f"{where}.{name}"
    if not -param.dim() <= axis < param.dim():
        raise ValueError(f"cannot shard '{where}' of shape {tuple(param.shape)} along axis "
                         f"{axis}: it has {param.dim()} axes")
    axis %= param.dim()
    spec = shard_spec(param)
    if spec is not None:
        if spec.axis != axis:
            raise ValueError(f"'{where}' is already sharded along axis {spec.axis}; "
                             f"cannot shard it along axis {axis} too")
        return
    _check_row_parallel(module, name, axis, where)
    world = sch.world_size
    if param.shape[axis] % world:
        raise ValueError(f"cannot shard '{where}' of shape {tuple(param.shape)} along axis "
                         f"{axis} over {world} ranks: {param.shape[axis]} is not divisible "
                         f"by {world}")
    local = param.detach().chunk(world, dim=axis)[sch.rank]
    new = nn.Parameter(local.clone(memory_format=torch.contiguous_format),
                       requires_grad=param.requires_grad)
    new.__dict__.update({k: v for k, v in param.__dict__.items() if k != "slapo_shard"})
    new.slapo_shard = ShardSpec(axis, world, tuple(param.shape))
    new.orig_shape = param.shape  # the full shape, under upstream Slapo's name
    # Swap every reference to the old parameter, so that tied parameters stay tied.
    for holder, pname in sch._replace_param_everywhere(param, new):
        _adjust_module(holder, pname, axis, world, sch, where)


def _adjust_module(module: nn.Module, pname: str, axis: int, world: int, sch, where: str) -> None:
    """Make a known module type compute its part of the result with a sharded parameter."""
    if pname != "weight":
        return
    if isinstance(module, nn.Linear):
        if axis == 0:
            module.out_features //= world
            _shard_bias(module, sch, where)
        else:
            module.in_features //= world
            if not state.has_row_parallel_forward(module):
                _use_deferred_bias(module)
    elif isinstance(module, nn.modules.conv._ConvNd):
        if axis == 0:
            module.out_channels //= world
            _shard_bias(module, sch, where)
        elif axis == 1:
            module.in_channels //= world
            _use_deferred_bias(module)
    elif isinstance(module, nn.Embedding):
        if axis == 0:
            _make_vocab_parallel(module, world, sch.rank)
        else:
            module.embedding_dim //= world


def _torch_base(module: nn.Module) -> type:
    """The class of torch.nn that ``module``'s class derives from (itself if it is one)."""
    return next(c for c in type(module).__mro__ if c.__module__.startswith("torch.nn."))


def _check_row_parallel(module: nn.Module, name: str, axis: int, where: str) -> None:
    """A row-parallel shard of a Linear or convolution with a bias runs the bias-free base
    computation and adds the bias once, after the partial results are summed. A subclass
    with a forward of its own would lose that forward's work, so it is refused, before any
    parameter changes."""
    if name != "weight" or axis != 1 or getattr(module, "bias", None) is None:
        return
    if state.has_row_parallel_forward(module):
        return  # it reduces before its bias itself (slapo.op.LinearWithSyncFunc)
    if not isinstance(module, (nn.Linear, nn.modules.conv._ConvNd)):
        return
    base = _torch_base(module)
    if type(module).forward is not base.forward:
        raise ValueError(
            f"cannot shard '{where}' along its input axis: {type(module).__name__} overrides "
            f"{base.__name__}.forward, and a row-parallel shard adds the bias after the "
            f"partial sums, which slapo can do only for {base.__name__}'s own computation "
            f"(its own forward would be lost). Shard a {base.__name__} (replace the module "
            "first), or one without a bias")


def _shard_bias(module: nn.Module, sch, weight_where: str) -> None:
    bias = module._parameters.get("bias")
    if bias is not None and shard_spec(bias) is None:
        _shard_param(sch, module, weight_where.rsplit(".", 1)[0], "bias", 0)


def _use_deferred_bias(module: nn.Module) -> None:
    if module.bias is None:
        return
    if isinstance(module, nn.Linear):
        module.forward = lambda x: F.linear(x, module.weight)
    else:
        module.forward = lambda x: module._conv_forward(x, module.weight, None)
    defer_bias(module)


def _make_vocab_parallel(emb: nn.Embedding, world: int, rank: int) -> None:
    part = emb.num_embeddings // world
    start = rank * part
    padding_idx = emb.padding_idx
    local_padding = padding_idx - start if padding_idx is not None and \
        start <= padding_idx < start + part else None
    emb.num_embeddings = part
    emb.padding_idx = local_padding
    if padding_idx is not None:
        state.set_full_padding_idx(emb, padding_idx)

    def forward(ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < start) | (ids >= start + part)
        local = (ids - start).masked_fill(outside, 0)
        out = F.embedding(local, emb.weight, local_padding, emb.max_norm, emb.norm_type,
                          emb.scale_grad_by_freq, emb.sparse)
        return out.masked_fill(outside.unsqueeze(-1), 0.0)

    emb.forward = forward
