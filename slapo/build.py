"""build: turn a schedule into the module to train."""

from __future__ import annotations

import contextlib
import gc
import inspect
import warnings
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from . import state
from .primitives.shard import full_layout, local_slice, shard_spec
from .sharding import first_rank, gather_sharded, world_size


def build(sch, target: str | None = None, init_weights: bool | Callable = True,
          device: str | torch.device | None = None, **kwargs) -> tuple:
    """Finish the scheduled model for a runtime; returns ``(model, optimizer)`` (upstream
    Slapo's contract).

    ``target``:

    - ``None``: ``(the scheduled nn.Module, None)``;
    - ``"deepspeed"``: ``deepspeed.initialize`` on the scheduled model with ``config=`` (a
      dict or a JSON path) and, optionally, ``optimizer=``: ``(engine, optimizer)``
      (``slapo.engines``); under ZeRO-3 the compiled regions become ZeRO-3 leaf modules, and
      with ``zero3_layer_leaves=True`` the transformer layers too; any target a
      ``"runtime_engine"`` dialect is registered for (``slapo.framework_dialect``) runs the
      same way. A schedule with pipeline cuts (after ``trace`` and ``cut_pipeline_stage``)
      runs on DeepSpeed's pipeline engine instead, as upstream's did: ``topology=``,
      ``config=`` and ``loss_fn=``, and ``engine.train_batch(data_iter)`` trains it
      (``slapo.pipeline.deepspeed_pipe``);
    - ``"pipeline"`` (after ``trace`` and ``cut_pipeline_stage``): this rank's stage on
      ``torch.distributed.pipelining``, ``(slapo.pipeline.PipelineBuild, None)``; ``kwargs`` go
      to ``slapo.pipeline.build_pipeline`` (``n_microbatches``, ``loss_fn``,
      ``schedule="GPipe"``, and ``group`` or ``topology``). Without ``topology``, one stage
      per rank of the group. With ``topology=slapo.Topology(dp=, pp=, tp=)`` (3D
      parallelism), the schedule was created over ``topology.tensor_group`` and sharded
      there, the cuts make ``pp`` stages, each rank builds its stage in its pipeline group,
      and ``PipelineBuild.step`` averages the gradients over the data group. A parameter
      that several stages use (tied weights) is held by each, one value for all, its
      gradients summed over them.

    ``init_weights`` (see :func:`initialize`): ``True`` (upstream's default) initialises every
    parameter anew, ``False`` keeps the weights as they are, a function ``fn(module)`` (or
    ``fn(module, path)``) initialises each module's own parameters. Either way a sharded
    parameter is initialised at its full shape and sliced, so that sharded and unsharded
    models start alike. A model created on the meta device (``slapo.init_empty_weights``)
    first gets storage on ``device`` (default: the current CUDA device if there is one, else
    the CPU); one left on the meta device (``init_weights=False``) is an error.

    ``build_module(sch)`` is the short form for the module alone, keeping its weights.
    """
    _check_reductions_have_shards(sch)
    _warn_of_tied_column_parallel(sch)
    if target == "pipeline":
        from .pipeline import build_pipeline
        pipe = build_pipeline(sch, device=device, **kwargs)
        # each stage initialises its own parameters, alike on the ranks that hold the stage
        stage_group = pipe.topology.stage_group if pipe.topology is not None else None
        _finish(pipe.module, init_weights, device, group=stage_group,
                broadcast=stage_group is not None, shard_group=sch.group)
        pipe.sync_tied_weights()  # tied weights held by several stages start alike
        return pipe, None
    if target == "deepspeed":
        from .pipeline.deepspeed_pipe import build_deepspeed_pipeline, has_cuts
        if has_cuts(sch):  # upstream's pipeline on DeepSpeed's engine
            def finish(module, stage_group):
                _finish(module, init_weights, device, group=stage_group, broadcast=True,
                        shard_group=sch.group)
            return build_deepspeed_pipeline(sch, finish, **kwargs)
    from .framework_dialect import get_all_dialects, get_dialect_cls
    if target not in get_all_dialects("runtime_engine"):
        known = (*get_all_dialects("runtime_engine"), "pipeline")
        raise ValueError(f"unknown build target {target!r}; expected one of {known}")
    if target is None and kwargs:
        raise ValueError(f"unexpected options for target None: {', '.join(kwargs)}")
    model = _finish(sch.mod, init_weights, device, group=sch.group, broadcast=True)
    return get_dialect_cls("runtime_engine", target)(model, **kwargs)


def _check_reductions_have_shards(sch) -> None:
    """Refuse an all-reduce (or reduce-scatter) sync on several ranks where no parameter of
    the model is sharded: every rank then holds the whole module, and the sync would sum
    ``world_size`` copies of its result (silently wrong numbers)."""
    if sch.world_size < 2 or any(shard_spec(p) is not None for p in sch.mod.parameters()):
        return
    for path, mod in sch.mod.named_modules():
        for mode, op in state.syncs(mod):
            if op not in ("all_reduce", "reduce_scatter"):
                continue
            raise ValueError(
                f"sync at '{path or '<root>'}' ({mode} {op}) on {sch.world_size} ranks, but "
                "nothing in the model is sharded: every rank holds the whole module, so the "
                f"{op} would sum {sch.world_size} copies of its result; shard the parameters "
                "it reduces for (shard) or drop the sync")


def _warn_of_tied_column_parallel(sch) -> None:
    """Warn of a Linear that a shard made column parallel through a tied weight (an LM head
    sharing a vocabulary-sharded embedding) without a sync on its input's gradient: that
    gradient is then this rank's partial sum, and every gradient below it is wrong, while
    the loss looks right."""
    for path, mod in sch.mod.named_modules():
        source = state.tied_column_parallel(mod)
        if source and not any(mode in ("bwd_post", "fwd_pre") for mode, _ in state.syncs(mod)):
            warnings.warn(
                f"'{path}' shares its weight with '{source}', sharded along axis 0: it is "
                "column parallel now, and the gradient of its input is this rank's partial "
                f"sum; unless its input arrives sharded, add sch['{path}'].sync('bwd_post', "
                "'all_reduce')", stacklevel=3)


def build_module(sch, init_weights: bool | Callable = False,
                 device: str | torch.device | None = None) -> nn.Module:
    """The scheduled ``nn.Module``, weights kept unless ``init_weights`` says otherwise
    (as in :func:`build`, whose first result this is)."""
    return build(sch, init_weights=init_weights, device=device)[0]


@contextlib.contextmanager
def init_empty_weights(enable: bool = True, include_buffers: bool = False):
    """Create models inside this block with their parameters on the meta device (shapes only,
    no memory); with ``include_buffers``, their buffers too. Schedule the model as usual, then
    ``build(sch, init_weights=fn)`` gives each rank's (sharded) parameters storage and
    initialises them. ``enable=False`` makes the block a no-op (upstream Slapo's spelling)::

        with slapo.init_empty_weights():
            model = BertForMaskedLM(config)
        sch = slapo.create_schedule(model)
        ...                                    # shard: each rank keeps meta slices
        model = slapo.build_module(sch, init_weights=model._init_weights)

    Built on PyTorch's parameter (and buffer) registration hooks: only modules created inside
    the block are affected, and tensors made outside modules are not.
    """
    if not enable:
        yield
        return

    def to_meta(module, name, tensor):
        if tensor is None or tensor.is_meta:
            return None  # keep it as given
        if isinstance(tensor, nn.Parameter):
            meta = type(tensor)(tensor.to("meta"), requires_grad=tensor.requires_grad)
            meta.__dict__.update(tensor.__dict__)
            return meta
        return tensor.to("meta")

    hooks = [nn.modules.module.register_module_parameter_registration_hook(to_meta)]
    if include_buffers:
        hooks.append(nn.modules.module.register_module_buffer_registration_hook(to_meta))
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def materialize(model: nn.Module, device: str | torch.device | None = None) -> nn.Module:
    """Give a model's meta parameters and buffers empty storage on ``device``, in place;
    the others are left as they are.

    Unlike ``Module.to_empty``, which replaces every parameter by a new object, this swaps the
    storage into the same objects (``torch.utils.swap_tensors``): a parameter tied to several
    modules stays one, and its attributes (shard spec, annotations) are kept.
    """
    if device is None:
        device = (torch.device("cuda", torch.cuda.current_device())
                  if torch.cuda.is_available() else torch.device("cpu"))
    meta = [param for param in model.parameters() if param.is_meta]  # each shared one once
    if any(weakref.getweakrefcount(param) for param in meta):
        # a trace's FakeTensorMode, unreachable but not yet collected (it lives in reference
        # cycles), keeps weak references to the parameters it saw, which swap_tensors refuses
        gc.collect()
    for param in meta:
        kept = dict(param.__dict__)  # the swap moves __dict__ with the storage
        torch.utils.swap_tensors(param, nn.Parameter(torch.empty_like(param, device=device),
                                                     requires_grad=param.requires_grad))
        param.__dict__.update(kept)
    for mod in model.modules():
        for name, buf in mod._buffers.items():
            if buf is not None and buf.is_meta:
                new = torch.empty_like(buf, device=device)
                new.__dict__.update(buf.__dict__)
                mod._buffers[name] = new
    return model


def initialize(model: nn.Module, init_weights: bool | Callable = True, group=None,
               broadcast: bool = True, shard_group=None) -> None:
    """Initialise every parameter of ``model`` in place, as the unsharded model would be.

    Modules are visited in ``Module.apply`` order (children first, as transformers' own
    initialisation does), each parameter once: a tied one by its first holder, while a later
    holder initialises a scratch copy. While a module is initialised its parameters have their
    full shape (a sharded one's ``ShardSpec.full_shape``); it is initialised by
    ``init_weights(module)`` (or ``(module, path)``) or, for ``True``, by the model's
    ``_init_weights(module)`` where it has one (transformers) and ``module.reset_parameters()``
    otherwise; modules with neither keep zeros, with a warning. With ``broadcast``, the full
    values are then broadcast from the first rank of ``group`` (when it has more than one), so
    that every rank holds the same model; each rank keeps its slice, by its rank in
    ``shard_group`` (the group the model was sharded over; default ``group``). The parameter
    objects stay the same, with their shard specs, annotations and ties.

    With ``True``, a module without parameters of its own is initialised too where the
    model's ``_init_weights`` writes parameters below it (GPT-2 scales ``c_proj`` from
    ``GPT2Attention`` and ``GPT2MLP``, T5 initialises its projections from ``T5Attention``),
    in ``apply`` order as transformers does: a trial call on full-shape meta tensors (no
    memory, no random draws) finds what it writes; the call then runs with those parameters at
    full shape (the others stay on the meta device unless it reads them), and they are
    broadcast and sliced as above.
    """
    if init_weights is True:
        init = getattr(model, "_init_weights", None)
        takes_path = False
    else:
        init = init_weights
        takes_path = len(inspect.signature(init).parameters) >= 2
    paths = {id(m): path for path, m in model.named_modules()}
    spread = broadcast and world_size(group) > 1
    shard_group = group if shard_group is None else shard_group
    rank = dist.get_rank(shard_group) if dist.is_initialized() else 0
    order, done, bare = [], set(), []
    model.apply(order.append)
    with torch.no_grad():
        for module in order:
            params = {name: p for name, p in module._parameters.items() if p is not None}
            own = {name: p for name, p in params.items() if id(p) not in done}
            if not params and init is not None and init_weights is True:
                _init_from_above(module, init, group, spread, rank, shard_group)
            if not own:
                continue
            done.update(id(p) for p in own.values())
            # every parameter of the module is swapped for a full-size one while it is
            # initialised: one initialised already (tied) must not be drawn again in place
            full = {name: nn.Parameter(torch.zeros(_full_shape(p), dtype=p.dtype,
                                                   device=p.device)) for name, p in params.items()}
            with _holding(module, full):
                if init is not None and takes_path:
                    init(module, paths[id(module)])
                elif init is not None:
                    init(module)
                elif hasattr(module, "reset_parameters"):
                    module.reset_parameters()
                else:
                    bare.append(paths[id(module)] or type(module).__name__)
            for name, param in own.items():
                value = full[name].data
                if spread:
                    dist.broadcast(value, src=first_rank(group), group=group)
                spec = shard_spec(param)
                if spec is not None:
                    value = local_slice(value, spec, rank)
                param.copy_(value)
    if bare:
        warnings.warn(f"no initialisation for the parameters of {', '.join(bare[:5])}: they are "
                      "zeros (pass init_weights=fn)", stacklevel=3)


class _WriteLog(TorchDispatchMode):
    """Records which of ``tensors`` (by key) an operation writes in place (through any view)."""

    def __init__(self, tensors: dict[int, torch.Tensor]):
        super().__init__()
        self.tensors, self.written = tensors, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                if isinstance(value, torch.Tensor):
                    self.written.update(key for key, t in self.tensors.items()
                                        if torch._C._is_alias_of(value, t))
        return func(*args, **kwargs)


@contextlib.contextmanager
def _swapped(holders: list[tuple[nn.Module, str, nn.Parameter]], new: dict[int, torch.Tensor]):
    """Each ``(module, name, param)`` of ``holders`` holds ``new[id(param)]`` instead."""
    for module, name, param in holders:
        module._parameters[name] = new[id(param)]
    try:
        yield
    finally:
        for module, name, param in holders:
            module._parameters[name] = param


def _init_from_above(module: nn.Module, call: Callable, group, spread: bool, rank: int,
                     shard_group=None) -> None:
    """``call(module)`` for a module without parameters of its own, where it writes parameters
    of its descendants (see ``initialize``); sharded ones are gathered over ``shard_group``
    (default ``group``) and this rank's slice (``rank`` in it) kept."""
    shard_group = group if shard_group is None else shard_group
    holders = [(sub, name, p) for sub in module.modules() if sub is not module
               for name, p in sub._parameters.items() if p is not None]
    below = {id(p): p for _, _, p in holders}
    if not below:
        return
    meta = {key: nn.Parameter(torch.empty(_full_shape(p), dtype=p.dtype, device="meta"))
            for key, p in below.items()}
    try:
        with _swapped(holders, meta), _WriteLog(meta) as log:
            call(module)
        written = log.written
    except Exception:  # noqa: BLE001 - an initialiser meta cannot run: take it as writing all
        written = set(below)
    if not written:
        return
    # only the written parameters get storage (a root's initialiser may write one embedding
    # of a large model); one that reads another parameter's values gets them all
    full = {**meta, **{key: nn.Parameter(_full_value(below[key], shard_group)) for key in written}}
    try:
        with _swapped(holders, full):
            call(module)
    except Exception:  # noqa: BLE001 - it read a parameter left on the meta device
        full = {key: nn.Parameter(_full_value(p, shard_group)) for key, p in below.items()}
        with _swapped(holders, full):
            call(module)
    for key in [key for key in below if key in written]:  # the same order on every rank
        value = full[key].data
        if spread:
            dist.broadcast(value, src=first_rank(group), group=group)
        spec = shard_spec(below[key])
        below[key].copy_(value if spec is None else local_slice(value, spec, rank))


def _full_value(param: torch.Tensor, group) -> torch.Tensor:
    """A copy of ``param`` at full shape (a collective for one sharded over ranks)."""
    spec = shard_spec(param)
    if spec is None or spec.world_size == 1:
        return param.detach().clone()
    return full_layout(gather_sharded(param, spec.axis, group), spec)


def _full_shape(param: torch.Tensor) -> tuple[int, ...]:
    spec = shard_spec(param)
    return spec.full_shape if spec is not None else tuple(param.shape)


@contextlib.contextmanager
def _holding(module: nn.Module, params: dict[str, nn.Parameter]):
    """``module`` with ``params`` in place of its own, as it was before sharding (a
    vocabulary-parallel embedding also gets its full ``padding_idx`` back), then restored."""
    saved = {name: module._parameters[name] for name in params}
    full_padding = state.full_padding_idx(module)
    local_padding = getattr(module, "padding_idx", None)
    module._parameters.update(params)
    if full_padding is not None:
        module.padding_idx = full_padding
    try:
        yield
    finally:
        module._parameters.update(saved)
        if full_padding is not None:
            module.padding_idx = local_padding


def _finish(model: nn.Module, init_weights, device, group, broadcast: bool,
            shard_group=None) -> nn.Module:
    if init_weights is None:
        init_weights = False
    if init_weights is not False:
        if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
            materialize(model, device)
        initialize(model, init_weights, group, broadcast, shard_group)
    meta = [name for name, p in model.named_parameters() if p.is_meta]
    if meta:
        raise ValueError(f"parameters still on the meta device after build: {', '.join(meta[:5])}"
                         f"{' ...' if len(meta) > 5 else ''}; pass init_weights, and build "
                         "gives them storage before calling it")
    return model
