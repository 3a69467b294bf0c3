"""build: turn a schedule into the module to train."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn


def build(sch, init_weights: Callable[[nn.Module], None] | None = None, target: str = "module",
          device: str | torch.device | None = None, **options):
    """Return the scheduled model, ready for an optimizer.

    Primitives take effect as they are applied, so ``build`` only finishes the model:
    ``init_weights(module)``, when given, is called on every submodule (under ``no_grad``) to
    initialise parameters after sharding. A model created on the meta device (shapes only,
    then scheduled: each rank's shards are meta too) is first given storage on ``device``
    (default: the current CUDA device if there is one, else the CPU) by :func:`materialize`,
    which keeps every parameter object, so that shard specs, annotations and ties survive;
    do not call ``to_empty`` yourself, which makes new parameters and loses them. Parameters
    still on the meta device after ``init_weights`` are an error.

    ``target="pipeline"`` (after ``trace`` and ``cut_pipeline_stage``) splits the traced model
    into one stage per rank and returns a ``slapo.pipeline.PipelineBuild`` for
    ``torch.distributed.pipelining``; ``options`` go to ``slapo.pipeline.build_pipeline``
    (``n_microbatches``, ``loss_fn``, ``schedule="GPipe"``, ``group``, ``device``)::

        pipe = slapo.build(sch, target="pipeline", n_microbatches=4, loss_fn=loss_fn)
    """
    if target == "pipeline":
        from .pipeline import build_pipeline
        pipe = build_pipeline(sch, **options)
        _finish(pipe.module, init_weights, device)
        return pipe
    if target != "module" or options:
        raise ValueError(f"unknown build target {target!r} (expected 'module' or 'pipeline')"
                         if target != "module" else
                         f"unexpected options for target 'module': {', '.join(options)}")
    return _finish(sch.mod, init_weights, device)


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
        model = slapo.build(sch, init_weights=model._init_weights)

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
    for param in model.parameters():  # each shared parameter once
        if param.is_meta:
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


def _finish(model: nn.Module, init_weights, device) -> nn.Module:
    if init_weights is not None:
        if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
            materialize(model, device)
        with torch.no_grad():
            model.apply(init_weights)
    meta = [name for name, p in model.named_parameters() if p.is_meta]
    if meta:
        raise ValueError(f"parameters still on the meta device after build: {', '.join(meta[:5])}"
                         f"{' ...' if len(meta) > 5 else ''}; pass init_weights, and build "
                         "gives them storage before calling it")
    return model
