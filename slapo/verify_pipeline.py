"""``slapo.Verify`` for a schedule that cuts pipeline stages: the plain model against the
pipeline that ``build(sch, target="pipeline", topology=...)`` makes of the schedule.

Upstream Slapo ran such a schedule through DeepSpeed's pipeline engine and compared its loss
with the plain model's; here the pipeline is this package's own (``torch.distributed.
pipelining``), so the check runs exactly what training runs, and it compares the gradients
as well: the pipeline computes them anyway, and a stage whose forward is right may still
train wrong (a missing backward all-reduce, a tied weight whose gradients are not summed).

Every data-parallel replica checks its own example batch (its first rank's); the pipeline
splits it into micro-batches (``torch.tensor_split`` along the first dimension) and its loss
is the mean of theirs, so the plain model computes the same micro-batches and means their
losses, which for a mean loss over equal micro-batches is the batch's loss. Losses and
gradients are then averaged over the replicas, as the pipeline's step averages its gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from .pipeline import pipeline_cuts
from .topology import Topology

# DeepSpeed's mixed-precision sections: the pipeline built here has no loss scaling or
# master weights, so a check in fp16/bf16 would not be the run that config describes.
MIXED_PRECISION = ("fp16", "bf16", "amp")


def check_arguments(sch, topology, config, loss_fn, targets) -> bool:
    """Whether the block is checked as a pipeline (it cuts stages), after checking that the
    arguments fit: a clear error naming what to pass where they do not."""
    cuts = pipeline_cuts(sch.root)
    if cuts and topology is None:
        raise ValueError(
            f"slapo.Verify: the schedule cuts pipeline stages (after {', '.join(cuts)}); pass "
            "topology=slapo.Topology(dp=, pp=, tp=) (the one the schedule's group came from) "
            "and config= (its micro-batch size), so that the check runs the pipeline")
    if not cuts:
        if topology is not None or config is not None:
            given = " and ".join(name for name, value in (("topology=", topology),
                                                          ("config=", config))
                                 if value is not None)
            raise ValueError(
                f"slapo.Verify: {given} are for a schedule that cuts pipeline stages, and no "
                "cut_pipeline_stage() was applied to it by the end of the block; cut the "
                f"stages inside the block, or leave out {given}")
        return False
    if loss_fn is None or targets is None:
        missing = " and ".join(name for name, value in (("loss_fn=", loss_fn),
                                                        ("example_outputs=", targets))
                               if value is None)
        raise ValueError(
            f"slapo.Verify: a pipeline's last stage computes the loss; pass {missing} "
            "(loss_fn(output, example_outputs), a mean over the batch)")
    if not isinstance(targets, torch.Tensor):
        raise TypeError("slapo.Verify: example_outputs of a pipeline must be a tensor (the "
                        "targets, split into micro-batches with the inputs), got "
                        f"{type(targets).__name__}")
    return True


def check_topology_and_config(topology, config) -> None:
    """Refuse a topology or config of the wrong kind, or a config that asks for what the
    pipeline built here does not do (``Verify`` calls it on creation)."""
    if topology is not None and not isinstance(topology, Topology):
        raise TypeError(
            f"slapo.Verify: topology= takes a slapo.Topology, got {type(topology).__name__} "
            "(for DeepSpeed's PipeModelDataParallelTopology, create slapo.Topology(dp=, pp=, "
            "tp=) with its degrees, or use "
            "slapo.framework_dialect.deepspeed.pipeline.create_dist_group_for_pipeline)")
    if config is None:
        return
    if not isinstance(config, Mapping):
        raise TypeError(f"slapo.Verify: config= takes a DeepSpeed config dict, got "
                        f"{type(config).__name__}")
    for key in MIXED_PRECISION:
        section = config.get(key)
        enabled = section.get("enabled", False) if isinstance(section, Mapping) else section
        if enabled not in (None, False):
            raise ValueError(
                f"slapo.Verify: the config enables {key}; the pipeline built here "
                "(build(target='pipeline')) runs the stages in the model's own dtype, without "
                f"DeepSpeed's loss scaling, so the check runs in float32: pass the config with "
                f"{key} disabled (get_ds_config(..., {key}=False) where {key} is its argument)")


def micro_batches(config, rows: int, dp: int) -> int:
    """How many micro-batches the pipeline splits an example batch of ``rows`` into: rows
    over the config's ``train_micro_batch_size_per_gpu`` or, without it, over
    ``train_batch_size / (gradient_accumulation_steps * dp)`` (DeepSpeed's relation between
    the three); one without a config or a batch size."""
    if config is None:
        return 1
    size = config.get("train_micro_batch_size_per_gpu")
    what = "train_micro_batch_size_per_gpu"
    if size is None and config.get("train_batch_size") is not None:
        total, steps = config["train_batch_size"], config.get("gradient_accumulation_steps", 1)
        if not all(isinstance(v, int) and v > 0 for v in (total, steps)) or total % (steps * dp):
            raise ValueError(f"slapo.Verify: config train_batch_size {total!r} is not a multiple "
                             f"of gradient_accumulation_steps {steps!r} x {dp} replicas")
        size, what = total // (steps * dp), "train_batch_size / (accumulation steps x replicas)"
    if size is None:
        return 1
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"slapo.Verify: config {what} must be a positive int, got {size!r}")
    if rows % size:
        raise ValueError(f"slapo.Verify: the example batch has {rows} rows, not a multiple of "
                         f"the micro-batch size {size} (config {what})")
    return rows // size


def plain_loss(model: nn.Module, inputs, targets: torch.Tensor, loss_fn: Callable,
               n: int, topology: Topology) -> torch.Tensor:
    """The plain model's loss, forward and backward, as the pipeline computes it: the mean
    over ``n`` micro-batches; loss and gradients averaged over the replicas."""
    chunks = [torch.tensor_split(v, n) if isinstance(v, torch.Tensor) else [v] * n
              for v in (inputs.values() if isinstance(inputs, dict) else inputs)]
    losses = []
    for k, target in enumerate(torch.tensor_split(targets, n)):
        args = [c[k] for c in chunks]
        out = model(**dict(zip(inputs, args))) if isinstance(inputs, dict) else model(*args)
        loss = loss_fn(out, target) / n
        loss.backward()
        losses.append(loss.detach())
    total = torch.stack(losses).sum()
    _mean_over_replicas([total, *(p.grad for p in model.parameters() if p.grad is not None)],
                        topology)
    return total


def pipeline_loss(pipe, inputs, targets: torch.Tensor, topology: Topology) -> torch.Tensor:
    """One step of the built pipeline (forward and backward; gradients reduced as in
    training): the mean of its micro-batch losses, on every rank, averaged over replicas."""
    args, kwargs = ((), inputs) if isinstance(inputs, dict) else (inputs, {})
    losses = pipe.step(*args, target=targets, **kwargs)
    total = torch.stack([loss.detach() for loss in losses]).mean() if pipe.is_last \
        else torch.zeros((), device=pipe.stage.device)
    dist.broadcast(total, src=topology.ranks("pipe")[-1], group=topology.pipeline_group)
    _mean_over_replicas([total], topology)
    return total


def _mean_over_replicas(tensors: list[torch.Tensor], topology: Topology) -> None:
    if topology.dp == 1:
        return
    for tensor in tensors:
        dist.all_reduce(tensor, group=topology.data_group)
        tensor /= topology.dp
