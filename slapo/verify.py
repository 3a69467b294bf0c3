"""Numerical verification: a scheduled model against the plain model it came from.

Both models train side by side on the same batches with SGD; after every step the losses,
the outputs and the gradient of every parameter (sharded ones gathered back to full shape)
are compared by relative error ``||a - b|| / max(||b||, 1e-3)``. Every rank computes the same
report. ``Verify`` is the same check, forward and backward, around a block of primitives.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from . import verify_pipeline as vp
from .logger import get_logger
from .primitives.shard import full_layout, local_slice, shard_spec
from .sharding import (
    all_gather_forward,
    broadcast_from_first,
    first_rank,
    gather_sharded,
    world_size,
)
from .tracing import has_foreign_hooks
from .tracing.adapter import adapter_of

logger = get_logger(__name__)

# Floor of the denominator: a gradient that is mathematically zero (a key bias under softmax)
# is numerical noise of ~1e-8, so it is compared absolutely rather than relatively.
ERROR_FLOOR = 1e-3


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / max(||expected||, ERROR_FLOOR)``, computed in float64."""
    actual, expected = actual.detach().double(), expected.detach().double()
    if actual.shape != expected.shape:
        raise ValueError(f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    return (actual - expected).norm().item() / max(expected.norm().item(), ERROR_FLOOR)


def full_tensor(param: nn.Parameter, value: torch.Tensor, group=None) -> torch.Tensor:
    """``value`` (the parameter or its gradient) at the parameter's full, unsharded shape.
    A collective for sharded parameters: every rank must call it in the same order."""
    spec = shard_spec(param)
    if spec is None:
        return value.detach()
    return full_layout(gather_sharded(value, spec.axis, group), spec)


@dataclass
class StepReport:
    """Errors of one training step: loss, output and each parameter's gradient."""
    loss_plain: float
    loss_scheduled: float
    output_error: float
    grad_errors: dict[str, float] = field(default_factory=dict)

    @property
    def loss_error(self) -> float:
        return abs(self.loss_scheduled - self.loss_plain) / max(abs(self.loss_plain), 1e-30)

    @property
    def max_grad_error(self) -> tuple[str, float]:
        name = max(self.grad_errors, key=self.grad_errors.get)
        return name, self.grad_errors[name]


def gradient_errors(plain: nn.Module, scheduled: nn.Module, group=None) -> dict[str, float]:
    """The relative error of each gradient of ``scheduled`` (the scheduled model or a
    pipeline stage of it; sharded gradients gathered) against the plain model's, by parameter
    name (a tied one by any of its names; parameters without a gradient in both left out).
    Collectives for sharded parameters: every rank must call it."""
    plain_params = dict(plain.named_parameters(remove_duplicate=False))  # any tied name
    errors = {}
    for name, param in scheduled.named_parameters():
        if name not in plain_params:
            raise KeyError(f"scheduled model has parameter '{name}' that the plain one lacks")
        expected = plain_params[name].grad
        grad = full_tensor(param, param.grad, group) if param.grad is not None else None
        if (grad is None) != (expected is None):
            raise AssertionError(f"gradient of '{name}' exists in only one model")
        if grad is not None:
            errors[name] = relative_error(grad, expected)
    return errors


def gathered_output(output: torch.Tensor, reference: torch.Tensor, group=None) -> torch.Tensor:
    """``output`` at ``reference``'s shape: a vocabulary-sharded output (the last axis split
    over the ranks, the last shard perhaps padded) is gathered, with autograd, and the padding
    dropped. A collective where the shapes differ, as they do on every rank alike."""
    if output.shape == reference.shape:
        return output
    output = all_gather_forward(output, -1, group, tensor_parallel_output_grad=False)
    return output[..., :reference.shape[-1]]


def train_side_by_side(plain: nn.Module, scheduled: nn.Module, batches: Iterable[dict],
                       forward: Callable[[nn.Module, dict], tuple[torch.Tensor, torch.Tensor]],
                       lr: float = 0.1, group=None) -> list[StepReport]:
    """Train both models one SGD step per batch and report the errors of every step.

    ``forward(model, batch)`` returns ``(loss, output)``; a vocabulary-sharded output is
    gathered to be compared. Parameters are matched by name, so the scheduled model must keep
    the plain model's parameter names.
    """
    opt_plain = torch.optim.SGD(plain.parameters(), lr=lr)
    opt_sched = torch.optim.SGD(scheduled.parameters(), lr=lr)
    reports = []
    for batch in batches:
        loss_p, out_p = forward(plain, batch)
        loss_s, out_s = forward(scheduled, batch)
        loss_p.backward()
        loss_s.backward()
        out_s = gathered_output(out_s.detach(), out_p, group)
        report = StepReport(loss_p.item(), loss_s.item(), relative_error(out_s, out_p),
                            gradient_errors(plain, scheduled, group))
        reports.append(report)
        opt_plain.step()
        opt_sched.step()
        opt_plain.zero_grad()
        opt_sched.zero_grad()
    return reports


class Verify(contextlib.ContextDecorator):
    """Check that the primitives applied inside the block keep the model's results: upstream
    Slapo's ``slapo.Verify``, checking the backward as well as the forward.

    ::

        with slapo.Verify(sch, example_inputs=[ids]):
            sch["encoder.layer.0.attention.self.query"].shard("weight", axis=0)
            ...

    On entry the model is copied; on leaving the block (without an exception) the copy and the
    scheduled model run on ``example_inputs`` (positional, or a dict of keyword arguments),
    broadcast from the first rank of the schedule's group, with the same seed and, by default,
    in eval mode. The outputs (``logits`` of a transformers output; a vocabulary-sharded
    output is gathered) must agree, and so must the gradient of every parameter, sharded ones
    gathered, of ``loss_fn(output, example_outputs)`` or, without ``loss_fn``, of a fixed
    random projection of the output. A disagreement raises ``AssertionError`` naming the
    output or the parameter and the relative error (against ``tol``). The scheduled model is
    left as it was: gradients, train/eval mode and the random state are restored.
    ``enable=False`` skips the check. Every rank of the group must enter the block, before any
    primitive has touched the model (the copy must be the plain model).

    ``device`` (upstream's argument): the device the check runs on; the models and the inputs
    are moved there (the scheduled model stays there). A model whose parameters are on the
    meta device (``slapo.init_empty_weights``) gets storage there and is initialised first,
    as ``build`` initialises it (``init_weights``, default: the model's own initialisation;
    sharded parameters at full shape, sliced): the scheduled model keeps those weights, and
    the plain copy gets the same full values. Any other model runs from the first rank's
    weights, as ``build`` broadcasts them: the plain copy takes them and the scheduled
    model its slices of them (keeping them afterwards).

    A block that cuts pipeline stages (``cut_pipeline_stage``, after ``trace``) is checked
    through the pipeline itself (``slapo.verify_pipeline``): pass ``topology=``, the
    ``slapo.Topology(dp=, pp=, tp=)`` whose tensor group the schedule was created over (as
    ``create_dist_group_for_pipeline`` returns it), ``loss_fn`` and ``example_outputs``
    (the targets), and optionally ``config=``, a DeepSpeed config dict, of which its
    micro-batch size (``train_micro_batch_size_per_gpu``, or ``train_batch_size`` over the
    accumulation steps and replicas) sets how many micro-batches the example batch makes
    (one without it); fp16/bf16 are refused (the check runs in float32). Every rank starts
    from the same weights (the first rank's, or initialised as above); each data-parallel
    replica checks its own batch (its first rank's), and ``build(sch, target="pipeline",
    topology=...)`` runs one step of it: the mean of the micro-batches' losses and every
    stage's gradients after the step's reduction (tied weights summed, replicas averaged)
    must agree with the plain model's on the same micro-batches, averaged over the replicas
    in the same way. The scheduled model keeps those weights, and can be built again. With
    ``eval_mode=False`` the models train; random layers (dropout) then draw differently in
    the stages, so check such a model in eval mode.
    """

    def __init__(self, sch, example_inputs, example_outputs=None, loss_fn: Callable | None = None,
                 eval_mode: bool = True, enable: bool = True, tol: float = 1e-5, seed: int = 2023,
                 device: str | torch.device | None = None,
                 init_weights: bool | Callable = True, topology=None, config=None):
        vp.check_topology_and_config(topology, config)
        self.sch, self.inputs, self.targets = sch, example_inputs, example_outputs
        self.loss_fn, self.eval_mode, self.enable = loss_fn, eval_mode, enable
        self.tol, self.seed = tol, seed
        self.device, self.init_weights = device, init_weights
        self.topology, self.config = topology, config
        self.original = None

    def __enter__(self):
        if self.enable:
            changed = [path or "<root>" for path, m in self.sch.mod.named_modules()
                       if has_foreign_hooks(m)]
            if changed:  # a copy would still call the originals through their hooks
                raise ValueError(f"slapo.Verify: {', '.join(changed[:3])} already carry "
                                 "primitives (hooks or a replaced forward); apply the "
                                 "primitives inside the block, on the model as it was made")
            self.original = copy.deepcopy(self.sch.mod)
        return self

    def __exit__(self, exc_type, *exc):
        if exc_type is not None or not self.enable:
            return False
        pipelined = vp.check_arguments(self.sch, self.topology, self.config, self.loss_fn,
                                       self.targets)
        scheduled = self.sch.mod
        saved_grads = {name: p.grad for name, p in scheduled.named_parameters()}
        modes = {m: m.training for m in scheduled.modules()}
        # the check seeds torch (CUDA's generator too): the caller's random state is restored
        cuda = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
        try:
            with torch.random.fork_rng(devices=cuda):
                if pipelined:
                    self._check_pipeline()
                else:
                    self._check_block()
        finally:
            for name, param in scheduled.named_parameters():
                param.grad = saved_grads[name]
            for module, training in modes.items():
                module.train(training)
            self.original = None
        return False

    def _check_block(self) -> None:
        group = self.sch.group
        self._place(group)
        inputs = _broadcast(_to(self.inputs, self.device), group)
        out_plain, loss_plain = self._run(self.original, inputs, None, group)
        out_sched, loss_sched = self._run(self.sch.mod, inputs, out_plain, group)
        hint = self._mode_hint()
        _check("the output", relative_error(out_sched, out_plain), self.tol, hint)
        _check("the loss", relative_error(loss_sched, loss_plain), self.tol, hint)
        for name, error in gradient_errors(self.original, self.sch.mod, group).items():
            _check(f"the gradient of '{name}'", error, self.tol, hint)

    def _mode_hint(self) -> str:
        """Why a model with dropout may differ: a part was traced in the other mode than the
        check's."""
        if not any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0
                   for m in self.sch.mod.modules()):
            return ""
        other = [adapter.where for m in self.sch.mod.modules()
                 if (adapter := adapter_of(m)) is not None and adapter.training == self.eval_mode]
        if not other:
            return ""
        return (f"; '{other[0]}' was traced in {'train' if self.eval_mode else 'eval'} mode and "
                f"is checked in {'eval' if self.eval_mode else 'train'} mode, and a trace keeps "
                "the code paths of its mode (traced in eval mode, transformers' attention has "
                "no dropout): trace it in the mode of the check, or check it with dropout off")

    def _check_pipeline(self) -> None:
        """The plain model against the pipeline ``build(target="pipeline")`` makes of the
        schedule (``slapo.verify_pipeline``): the loss and every stage's gradients."""
        from .build import build
        topo = self.topology
        self._place(None, shard_group=self.sch.group)  # the stages of all ranks start alike
        def replica_batch(values):  # as the replica's first rank has them
            return _broadcast(_broadcast(values, topo.tensor_group), topo.pipeline_group)

        inputs = replica_batch(_to(self.inputs, self.device))
        targets = replica_batch([_to(self.targets, self.device)])[0]
        rows = next(v for v in (inputs.values() if isinstance(inputs, dict) else inputs)
                    if isinstance(v, torch.Tensor)).shape[0]
        n = vp.micro_batches(self.config, rows, topo.dp)
        for model in (self.original, self.sch.mod):
            model.train(not self.eval_mode)
        torch.manual_seed(self.seed)
        loss_plain = vp.plain_loss(self.original, inputs, targets, self.loss_fn, n, topo)
        pipe, _ = build(self.sch, target="pipeline", topology=topo, n_microbatches=n,
                        loss_fn=self.loss_fn, init_weights=False, device=self.device)
        torch.manual_seed(self.seed)
        loss_pipe = vp.pipeline_loss(pipe, inputs, targets, topo)
        grads = gradient_errors(self.original, pipe.module, self.sch.group)
        mine = ((relative_error(loss_pipe, loss_plain), loss_pipe.item(), loss_plain.item()),
                max(((error, name) for name, error in grads.items()), default=(0.0, "")))
        # every rank judges by the worst loss and gradient of all (each holds one stage)
        everywhere = [None] * dist.get_world_size()
        dist.all_gather_object(everywhere, mine)
        (loss_error, pipe_value, plain_value), _ = max(everywhere, key=lambda m: m[0])
        grad_error, grad_name = max(m[1] for m in everywhere)
        hint = self._mode_hint()
        _check(f"the pipeline's loss ({pipe_value:.6g}; the plain model's {plain_value:.6g})",
               loss_error, self.tol, hint)
        _check(f"the gradient of '{grad_name}'", grad_error, self.tol, hint)
        logger.info("slapo.Verify: the pipeline of %d stages on %d micro-batches computes the "
                    "plain model's loss (%.6g; the plain model's %.6g; relative error %.2g) and "
                    "gradients (worst relative error %.2g, '%s')", pipe.num_stages, n,
                    pipe_value, plain_value, loss_error, grad_error, grad_name, ranks=0)

    def _place(self, group, shard_group=None) -> None:
        """Both models on ``device`` and starting alike on every rank of ``group``: a meta
        model is given storage and initialised (the plain copy gets the full values), any
        other runs from the first rank's weights (the plain copy takes them, the scheduled
        model its slices of them, as ``build`` broadcasts them). Sharded parameters are
        sliced and gathered over ``shard_group`` (default ``group``), the schedule's group."""
        from .build import initialize, materialize
        scheduled, original = self.sch.mod, self.original
        shard_group = group if shard_group is None else shard_group
        if any(p.is_meta for p in scheduled.parameters()):
            materialize(scheduled, self.device)
            initialize(scheduled, self.init_weights, group, shard_group=shard_group)
            materialize(original, self.device)
            plain = dict(original.named_parameters())
            with torch.no_grad():
                for name, param in scheduled.named_parameters():  # the same order everywhere
                    full = full_tensor(param, param.detach(), shard_group)
                    if name in plain:
                        plain[name].copy_(full)
        elif world_size(group) > 1:
            rank = dist.get_rank(shard_group)
            plain = dict(original.named_parameters())
            with torch.no_grad():
                for param in plain.values():
                    dist.broadcast(param.data, src=first_rank(group), group=group)
                for name, param in scheduled.named_parameters():
                    if name in plain and (spec := shard_spec(param)) is not None:
                        param.copy_(local_slice(plain[name].data, spec, rank))
                    elif name in plain and param.shape == plain[name].shape:
                        param.copy_(plain[name].data)
        if self.device is not None:
            scheduled.to(self.device)
            original.to(self.device)

    def _run(self, model: nn.Module, inputs, reference, group):
        """Forward and backward; the output at full shape and the loss."""
        if self.eval_mode:
            model.eval()
        torch.manual_seed(self.seed)
        out = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
        logits = _main_output(out)
        if reference is not None:  # the loss below is then the same on every rank
            logits = gathered_output(logits, reference, group)
        if self.loss_fn is not None:
            loss = self.loss_fn(logits, self.targets)
        else:
            probe = torch.randn(logits.shape, generator=torch.Generator().manual_seed(self.seed),
                                dtype=logits.dtype).to(logits.device)
            loss = (logits * probe).mean()  # scaled like a mean loss
        loss.backward()
        return logits.detach(), loss.detach()


def _main_output(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict) and "logits" in out:  # transformers' ModelOutput
        return out["logits"]
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(f"slapo.Verify: cannot find the output tensor in a {type(out).__name__}")


def _to(inputs, device):
    """``inputs`` (a tensor, a sequence or a dict of them) with their tensors on ``device``."""
    if device is None:
        return inputs
    if isinstance(inputs, torch.Tensor):
        return inputs.to(device)
    if isinstance(inputs, dict):
        return {k: _to(v, device) for k, v in inputs.items()}
    if isinstance(inputs, (list, tuple)):
        return type(inputs)(_to(v, device) for v in inputs)
    return inputs


def _broadcast(inputs, group):
    """``inputs`` (a dict, a list or one value) as the first rank of ``group`` has them."""
    if isinstance(inputs, dict):
        return dict(zip(inputs, broadcast_from_first(list(inputs.values()), group)))
    return broadcast_from_first(list(inputs if isinstance(inputs, (list, tuple)) else [inputs]),
                                group)


def _check(what: str, error: float, tol: float, hint: str = "") -> None:
    if error > tol:
        raise AssertionError(f"slapo.Verify: {what} differs from the plain model's "
                             f"(relative error {error:.3g} > {tol:g}){hint}")
