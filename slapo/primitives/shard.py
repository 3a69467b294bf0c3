"""shard: split parameters across the ranks of the schedule's group."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import state
from ..hooks import defer_bias
from . import register_primitive
from ._params import get_param
from .base import keyword_aliases


@dataclass(frozen=True)
class ShardSpec:
    """How a sharded parameter was split: its axis, the world size and the full shape.

    ``parts``: the axis is made of that many equal blocks (the q, k and v columns of a fused
    projection), each split across the ranks; a rank holds its slice of every block, in order.
    ``padded``: zero entries appended to the axis before it was split (``shard(pad=True)``),
    so that the ranks divide it; the last rank(s) hold them, and the full tensor leaves
    them out.
    """
    axis: int
    world_size: int
    full_shape: tuple[int, ...]
    parts: int = 1
    padded: int = 0

    @property
    def local_size(self) -> int:
        """The length of the axis on each rank."""
        return (self.full_shape[self.axis] + self.padded) // self.world_size


def shard_spec(param: torch.Tensor) -> ShardSpec | None:
    """The ``ShardSpec`` of a parameter sharded by slapo, else None."""
    return getattr(param, "slapo_shard", None)


def local_slice(full: torch.Tensor, spec: ShardSpec, rank: int) -> torch.Tensor:
    """Rank ``rank``'s slice of the full-shape tensor ``full`` (a view where it can be)."""
    if spec.padded:
        shape = list(full.shape)
        shape[spec.axis] = spec.padded
        full = torch.cat([full, full.new_zeros(shape)], dim=spec.axis)
    blocks = full.chunk(spec.parts, dim=spec.axis)
    mine = [block.chunk(spec.world_size, dim=spec.axis)[rank] for block in blocks]
    return mine[0] if spec.parts == 1 else torch.cat(mine, dim=spec.axis)


def full_layout(gathered: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """The full tensor from the ranks' slices concatenated in rank order along the axis
    (what an all-gather gives): with ``parts`` blocks, each rank's slice of block 0 comes
    first, then of block 1, and so on."""
    if spec.padded:
        return gathered.narrow(spec.axis, 0, spec.full_shape[spec.axis])
    if spec.parts == 1:
        return gathered
    x = gathered.movedim(spec.axis, 0)
    rest = x.shape[1:]
    x = x.reshape(spec.world_size, spec.parts, -1, *rest).transpose(0, 1)
    return x.reshape(-1, *rest).movedim(0, spec.axis)


@register_primitive()
@keyword_aliases(tensor_name="param_names")  # upstream's name
def shard(sch, param_names: str | list[str], axis: int, *, parts: int = 1,
          pad: bool = False) -> None:
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
    - transformers' ``Conv1D`` (GPT-2's linear, weight ``(in, out)``, transposed from
      ``nn.Linear``'s): ``weight`` on axis 1 is column parallel (the bias follows), on axis 0
      row parallel (the bias is added once, after the forward syncs), as upstream Slapo has it.
      ``slapo.op.Conv1DGeLU`` shards as a Conv1D by columns only (GeLU of a partial sum is not
      the partial of a GeLU).

    ``parts`` (keyword; default 1): the axis holds that many equal blocks, each split across
    the ranks, and a rank keeps its slice of each block. GPT-2's ``c_attn`` computes q, k and v
    side by side; ``shard("weight", axis=1, parts=3)`` gives each rank the q, k and v columns
    of its own heads (its bias follows with the same ``parts``). The shard spec records it, so
    ``build`` and ``slapo.verify`` map slices to the full tensor.

    ``pad`` (keyword; default False): an axis the ranks do not divide is padded with zeros up
    to the next multiple of the world size first, and the last rank(s) hold the padding (as
    Megatron-LM pads a vocabulary, BERT's 30522 words on 4 ranks). It is meant for the
    vocabulary: an embedding never looks up the padded ids, a column-parallel LM head gives
    them logits that ``slapo.op.vocab_parallel_cross_entropy`` leaves out (it takes the
    vocabulary's size from the head's shard spec), and so their gradients are zero. A Linear's
    bias is padded with its weight. The spec records the padding: ``build``, gathering
    (``slapo.verify``) and checkpoints give the parameter at its own shape. Not with ``parts``.

    Parameters tied to the sharded one (for example an LM head sharing the word-embedding
    weight) are replaced by the same new parameter, and their modules adjusted too, so tied
    weights stay tied. Annotations move to the new parameter. Sharding an already sharded
    parameter again along the same axis is a no-op.

    Raises ``ValueError``, naming the parameter, when the axis size does not divide by the
    world size (times ``parts``) and ``pad`` is not given.

    Example::

        sch["encoder.layer.0.attention.self.query"].shard(["weight", "bias"], axis=0)
        sch["encoder.layer.0.attention.output.dense"].shard("weight", axis=1)
    """
    if not isinstance(parts, int) or parts < 1:
        raise ValueError(f"shard at '{sch.path or '<root>'}': parts must be a positive integer, "
                         f"got {parts!r}")
    if pad and parts > 1:
        raise ValueError(f"shard at '{sch.path or '<root>'}': pad=True splits one range; it "
                         f"cannot pad {parts} parts")
    where = sch.path or "<root>"
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise TypeError(f"shard at '{where}': axis must be an integer, got {axis!r}")
    names = [param_names] if isinstance(param_names, str) else list(param_names)
    if not names:
        raise ValueError(f"shard at '{where}': no parameter named (give a name such as "
                         "'weight', or a list of them)")
    for name in names:
        if sch.mod._buffers.get(name) is not None:
            _shard_buffer(sch, where, name, axis)
        else:
            _shard_param(sch, sch.mod, where, name, axis, parts, pad)


def _shard_buffer(sch, where: str, name: str, axis: int) -> None:
    """This rank's slice of a buffer, such as a BatchNorm's running statistics over the
    channels a rank holds (upstream's WideResNet schedule shards them so): sliced, with
    nothing to gather or reduce, since a buffer has no gradient."""
    buf = sch.mod._buffers[name]
    where = f"{where}.{name}"
    if not -buf.dim() <= axis < buf.dim():
        raise ValueError(f"cannot shard '{where}' of shape {tuple(buf.shape)} along axis "
                         f"{axis}: it has {buf.dim()} axes")
    if buf.shape[axis] % sch.world_size:
        raise ValueError(f"cannot shard '{where}' of shape {tuple(buf.shape)} along axis "
                         f"{axis} over {sch.world_size} ranks: {buf.shape[axis]} is not "
                         f"divisible by {sch.world_size}")
    sch.mod._buffers[name] = buf.chunk(sch.world_size, dim=axis)[sch.rank].clone()


def _shard_param(sch, module: nn.Module, where: str, name: str, axis: int,
                 parts: int = 1, pad: bool = False) -> None:
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
        if spec.axis != axis or spec.parts != parts:
            raise ValueError(f"'{where}' is already sharded along axis {spec.axis} in "
                             f"{spec.parts} part(s); cannot shard it along axis {axis} in "
                             f"{parts} part(s) too")
        return
    _check_row_parallel(module, name, axis, where)
    if parts > 1 and axis == 0 and any(isinstance(m, nn.Embedding)
                                       for m, _ in sch.param_owners(param)):
        raise ValueError(f"cannot shard '{where}' along its vocabulary in {parts} parts: a "
                         "vocabulary-parallel embedding keeps one contiguous range of ids")
    world = sch.world_size
    padded = -param.shape[axis] % world if pad else 0
    if (param.shape[axis] + padded) % (world * parts):
        split = f"in {parts} parts, each over {world} ranks" if parts > 1 else \
            f"over {world} ranks"
        hint = "" if parts > 1 else " (a vocabulary: shard it with pad=True)"
        raise ValueError(f"cannot shard '{where}' of shape {tuple(param.shape)} along axis "
                         f"{axis} {split}: {param.shape[axis]} is not divisible by "
                         f"{world * parts}{hint}")
    spec = ShardSpec(axis, world, tuple(param.shape), parts, padded)
    local = local_slice(param.detach(), spec, sch.rank)
    new = nn.Parameter(local.clone(memory_format=torch.contiguous_format),
                       requires_grad=param.requires_grad)
    new.__dict__.update({k: v for k, v in param.__dict__.items() if k != "slapo_shard"})
    new.slapo_shard = spec
    new.orig_shape = param.shape  # the full shape, under upstream Slapo's name
    # Swap every reference to the old parameter, so that tied parameters stay tied.
    for holder, pname in sch._replace_param_everywhere(param, new):
        _adjust_module(holder, pname, spec, sch, where)
        if holder is not module and isinstance(holder, nn.Linear) and pname == "weight" \
                and spec.axis == 0:
            state.mark_tied_column_parallel(holder, where)  # build checks its syncs


def _hf_conv1d() -> type | None:
    """transformers' ``Conv1D`` class if transformers is loaded (no module can be one
    otherwise, and slapo imports transformers only where a feature needs it)."""
    return getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)


def _is_conv1d(module: nn.Module) -> bool:
    """A transformers ``Conv1D`` (``slapo.op.Conv1DGeLU`` included)."""
    conv1d = _hf_conv1d()
    return conv1d is not None and isinstance(module, conv1d)


def _adjust_module(module: nn.Module, pname: str, spec: ShardSpec, sch, where: str) -> None:
    """Make a known module type compute its part of the result with a sharded parameter."""
    if pname != "weight":
        return
    axis, local = spec.axis, spec.local_size
    if _is_conv1d(module):
        if axis == 1:
            module.nf = local
            _shard_bias(module, sch, where, spec)
        else:
            module.nx = local
            _row_parallel(module, where, spec)
    elif isinstance(module, nn.Linear):
        if axis == 0:
            module.out_features = local
            _shard_bias(module, sch, where, spec)
        else:
            module.in_features = local
            if not state.has_row_parallel_forward(module):
                _row_parallel(module, where, spec)
    elif isinstance(module, nn.modules.conv._ConvNd):
        if axis == 0:
            module.out_channels = local
            _shard_bias(module, sch, where, spec)
        elif axis == 1:
            module.in_channels = local
            _row_parallel(module, where, spec)
    elif isinstance(module, nn.Embedding):
        if axis == 0:
            _make_vocab_parallel(module, local, sch.rank)
        else:
            module.embedding_dim = local


def _torch_base(module: nn.Module) -> type:
    """The class of torch.nn that ``module``'s class derives from (itself if it is one)."""
    return next(c for c in type(module).__mro__ if c.__module__.startswith("torch.nn."))


def _check_row_parallel(module: nn.Module, name: str, axis: int, where: str) -> None:
    """A row-parallel shard of a Linear, convolution or Conv1D with a bias runs the bias-free
    base computation and adds the bias once, after the partial results are summed. A subclass
    with a forward of its own would lose that forward's work, so it is refused, before any
    parameter changes."""
    if _is_conv1d(module):
        if name == "weight" and axis == 0 and type(module).forward is not _hf_conv1d().forward:
            raise ValueError(
                f"cannot shard '{where}' along its input axis (0): {type(module).__name__} "
                "computes more than transformers' Conv1D (x @ weight + bias), and a "
                "row-parallel shard gives partial sums that only a plain Conv1D may return. "
                "Shard it by columns (axis 1), or shard a plain Conv1D")
        return
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


def _shard_bias(module: nn.Module, sch, weight_where: str, weight: ShardSpec) -> None:
    """Shard the bias of output features as their weight was (its parts, its padding)."""
    bias = module._parameters.get("bias")
    if bias is not None:  # already sharded the same way: a no-op; otherwise: an error
        _shard_param(sch, module, weight_where.rsplit(".", 1)[0], "bias", 0, weight.parts,
                     pad=weight.padded > 0)


def _row_parallel(module: nn.Module, where: str, spec: ShardSpec) -> None:
    """Make a module sharded along its input features compute its partial sum: the
    bias-free computation, with the bias (if any) added once after the forward syncs
    (``defer_bias``). On several ranks its forward also checks that its input arrives split:
    an input with all the features (no column-parallel partner before it, no split) is an
    error naming the weight, where torch's would name two shapes only. A bias-free module
    of a subclass keeps its own forward (``_check_row_parallel`` refuses one with a bias)."""
    if module.bias is None and (spec.world_size == 1 or type(module).forward is not
                                _torch_base_forward(module)):
        return
    if _is_conv1d(module):
        compute, channel_axis = (lambda x: torch.matmul(x, module.weight)), -1
    elif isinstance(module, nn.Linear):
        compute, channel_axis = (lambda x: F.linear(x, module.weight)), -1
    else:  # a convolution: channels before its spatial axes, (N,) C, H, W
        compute, channel_axis = (lambda x: module._conv_forward(x, module.weight, None)), \
            -len(module.kernel_size) - 1
    local, full = spec.local_size, spec.full_shape[spec.axis]

    def forward(x: torch.Tensor) -> torch.Tensor:
        # Shapes are static here: under torch.compile this test costs nothing at run time.
        if spec.world_size > 1 and x.shape[channel_axis] != local:
            raise ValueError(
                f"'{where}' is sharded along its input features (row parallel) over "
                f"{spec.world_size} ranks: each rank takes {local} of its {full} input "
                f"features, but its input has {x.shape[channel_axis]}. Its input must arrive "
                "split: shard the module that computes it along its output features "
                "(column parallel), or split it with a fwd_pre sync")
        return compute(x)

    module.forward = forward
    if module.bias is not None:
        defer_bias(module)


def _torch_base_forward(module: nn.Module):
    """The forward of the class ``module``'s type derives from: transformers' ``Conv1D``
    or the torch.nn base."""
    return _hf_conv1d().forward if _is_conv1d(module) else _torch_base(module).forward


def _make_vocab_parallel(emb: nn.Embedding, part: int, rank: int) -> None:
    """This rank looks up ids ``[rank * part, (rank + 1) * part)``; others give zeros."""
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

    forward.vocab_range = (start, part)  # for take_local_ids
    emb.forward = forward


def take_local_ids(emb: nn.Module) -> bool:
    """Make a vocabulary-parallel embedding look up the ids it is given as this rank's own
    (a plain lookup of its rows), where a schedule's own ``fwd_pre`` hook makes them local, as
    upstream's schedules did: masking them again as global ids would look up zeros. True when
    ``emb`` was such an embedding."""
    if not hasattr(getattr(emb, "forward", None), "vocab_range"):
        return False
    del emb.forward  # nn.Embedding's own, over this rank's rows and local padding index
    return True
