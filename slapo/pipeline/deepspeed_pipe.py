"""Pipeline stages on DeepSpeed's pipeline engine: upstream Slapo's
``build(sch, target="deepspeed", topology=..., config=..., loss_fn=...)`` for a schedule with
pipeline cuts, so that a training script written for upstream (``engine.train_batch``) runs
as it was.

The stages are ``split_stages``' (the same as ``build(target="pipeline")``'s), each one layer
of a ``deepspeed.pipe.PipelineModule`` with one layer per stage; DeepSpeed runs its
schedule, sends the activations between stages, averages the gradients over the data-parallel
replicas and steps its optimizer. A parameter that several stages hold (tied weights) is a
``runtime.Tie``: its copies start equal and DeepSpeed's engine sums their gradients over the
stages that hold them, as it does for its own tied layers (upstream needed a patched DeepSpeed
for this, and ignored tied weights without one).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from .. import state
from ..engines import config_dict
from ..topology import Topology
from .partition import pipeline_cuts, shared_parameters, split_stages
from .runtime import _check_tensor_group, _plain_last_output, _ties, sync_ties


class DeepSpeedStage(nn.Module):
    """One pipeline stage as a layer of DeepSpeed's ``PipelineModule``, which calls each
    layer with one argument: the previous stage's output, a tensor or a tuple of them (for
    the first stage, the micro-batch's inputs, in the traced model's argument order).

    DeepSpeed's engine backpropagates into every floating tensor a stage passes on and sends
    the gradient of every floating tensor a stage receives. A stage here also passes floats
    that need none (a mask or rotary embeddings made from the inputs): each such output
    becomes a leaf that takes a gradient (which goes nowhere), and each floating input gets
    a gradient even where the stage does not differentiate through it (zeros)."""

    def __init__(self, stage: nn.Module, first: bool, last: bool):
        super().__init__()
        self.stage, self.first, self.last = stage, first, last

    def forward(self, inputs):
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        outputs = self.stage(*args)
        received = [] if self.first else [t for t in args if t.is_floating_point()]
        many = isinstance(outputs, tuple)
        outputs = list(outputs) if many else [outputs]
        carrier = next((k for k, t in enumerate(outputs) if t.requires_grad), None)
        if received and carrier is not None:
            outputs[carrier] = _GradForEach.apply(outputs[carrier], *received)
        if not self.last:
            outputs = [t.detach().requires_grad_() if t.is_floating_point() and
                       not t.requires_grad else t for t in outputs]
        return tuple(outputs) if many else outputs[0]


class _GradForEach(torch.autograd.Function):
    """``output`` itself; its backward also gives each of ``inputs`` a zero gradient, added to
    any gradient they get along other paths."""

    @staticmethod
    def forward(ctx, output, *inputs):
        ctx.like = [(t.shape, t.dtype, t.device) for t in inputs]
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        return (grad, *(torch.zeros(shape, dtype=dtype, device=device)
                        for shape, dtype, device in ctx.like))


def _mark_for_the_gradient_norm(module: nn.Module, ties, topology: Topology) -> None:
    """Mark where each parameter of this stage counts in DeepSpeed's gradient norm (gradient
    clipping), once over the stages and tensor-parallel ranks. DeepSpeed counts a parameter
    on the first rank of its model-parallel group (all stages and tensor ranks together) or
    where it is marked model parallel (Megatron's ``tensor_model_parallel``), and leaves out
    a copy marked ``ds_pipe_replicated`` (its own tied layers, on all but their first
    stage). So: a sharded parameter counts on every tensor rank, a replicated one on the
    stage's first tensor rank, and a tied weight in the first stage that holds it only
    (unmarked, a later stage's parameters counted nowhere: measured, DeepSpeed 0.19.8
    clipped a 2-stage LLaMA by its first stage's norm)."""
    ranks_per_stage = topology.dp * topology.tp  # a stage's ranks are a block (the layout)
    later_copies = {id(tie.param) for tie in ties
                    if tie.src // ranks_per_stage != topology.stage_index}
    for param in module.parameters():
        replicated_copy = id(param) in later_copies
        param.ds_pipe_replicated = replicated_copy
        sharded = getattr(param, "slapo_shard", None) is not None
        param.tensor_model_parallel = not replicated_copy and (
            sharded or topology.tensor_rank == 0)


def model_loss(outputs, labels):
    """The loss the model computed itself, as DeepSpeed takes it without a ``loss_fn``: the
    last stage's output, or its first tensor (a transformers model traced with its labels
    gives its loss first); the micro-batch's labels are not used."""
    loss = outputs[0] if isinstance(outputs, tuple) else outputs
    if loss.dim() != 0:
        raise ValueError(f"the last pipeline stage gives no loss (its output has shape "
                         f"{tuple(loss.shape)}): pass build(..., loss_fn=fn(outputs, labels)), "
                         "or trace the model with its labels so that it computes its loss")
    return loss


def has_cuts(sch) -> bool:
    """True when the schedule's root was cut into pipeline stages."""
    root = sch.root
    return state.is_pipeline_partition(root.mod) or bool(pipeline_cuts(root))


def build_deepspeed_pipeline(sch, finish, topology=None, config=None, loss_fn=None,
                             optimizer=None, **kwargs) -> tuple:
    """This rank's stage of ``sch`` (traced, cut) under DeepSpeed's pipeline engine; returns
    ``(engine, optimizer)`` from ``deepspeed.initialize``: train with
    ``engine.train_batch(data_iter)``, whose micro-batches are ``(inputs, labels)`` pairs.

    ``topology``: a ``slapo.Topology`` or DeepSpeed's ``PipeModelDataParallelTopology``
    (the same rank layout), with as many stages as the cuts make; the schedule must have been
    created over its tensor-parallel group. ``config``: DeepSpeed's configuration (a dict or
    the path of a JSON file), whose ``train_micro_batch_size_per_gpu`` and accumulation steps
    make the micro-batches; DeepSpeed's split of a stage's first output over the
    tensor-parallel ranks (``pipeline.pipe_partitioned``, ``grad_partitioned``) is off unless
    it turns it on (it takes stages that pass one tensor that needs a gradient).
    ``loss_fn(outputs, labels)`` runs on the last stage (default: the loss the schedule took
    from the model when its root was traced, if any, else the model's own, ``model_loss``,
    as upstream passed ``loss_fn=None`` to DeepSpeed). ``finish(module, group)`` initialises
    this rank's stage (``build``'s ``init_weights``), the same on every rank of the stage.
    Other keyword arguments go to ``deepspeed.initialize``."""
    import deepspeed
    from deepspeed import pipe
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    if topology is None:
        raise ValueError("build(target='deepspeed') of a schedule with pipeline cuts needs "
                         "topology= (slapo.Topology or DeepSpeed's "
                         "PipeModelDataParallelTopology)")
    if config is None:
        raise ValueError("build(target='deepspeed') needs config=, DeepSpeed's configuration "
                         "(a dict or the path of a JSON file)")
    if not isinstance(topology, Topology):  # DeepSpeed's: the same layout, our groups
        topology = Topology(dp=topology.get_dim("data"), pp=topology.get_dim("pipe"),
                            tp=topology.get_dim("model"))
    _check_tensor_group(sch.root, topology)
    stages = split_stages(sch, tied=True)
    if len(stages) != topology.pp:
        raise ValueError(f"{len(stages)} pipeline stages ({len(stages) - 1} cuts) for a "
                         f"topology with pp={topology.pp}")
    if loss_fn is None:
        loss_fn = state.pipeline_loss(sch.root) or model_loss
    index = topology.stage_index
    module, last = stages[index], index == topology.pp - 1
    if last:
        _plain_last_output(module)
    finish(module, topology.stage_group)
    ties = _ties(shared_parameters(stages), index, topology.ranks("pipe"),
                 topology.pipeline_group, module)
    sync_ties(ties)  # every copy of a tied weight starts as its first holder's
    _mark_for_the_gradient_norm(module, ties, topology)

    deepspeed.init_distributed()
    ds_topology = PipeModelDataParallelTopology(num_pp=topology.pp, num_mp=topology.tp,
                                                num_dp=topology.dp)

    class _Stages(pipe.PipelineModule):  # here: DeepSpeed is imported when a pipeline is built
        def get_tied_weights_and_groups(self):
            # the engine all-reduces these gradients over their groups after the backward
            return [(tie.param, tie.group) for tie in ties]

    # DeepSpeed builds only this rank's layer; the others are placeholders, so that the engine
    # keeps no reference to the other stages' modules and weights
    layers = [pipe.LayerSpec(nn.Identity) for _ in stages]
    layers[index] = DeepSpeedStage(module, index == 0, last)
    model = _Stages(layers, topology=ds_topology, loss_fn=loss_fn, partition_method="uniform")
    # DeepSpeed splits a stage's first output over the tensor-parallel ranks by default, for
    # stages whose other outputs need no gradient; a stage here may pass several that do
    config = copy.deepcopy(config_dict(config))
    pipeline = config.setdefault("pipeline", {})
    pipeline.setdefault("pipe_partitioned", False)
    pipeline.setdefault("grad_partitioned", False)
    # the parameters for the config's optimizer or for a callable that makes one
    params = None if isinstance(optimizer, torch.optim.Optimizer) else \
        [p for p in model.parameters() if p.requires_grad]
    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=config,
                                                   optimizer=optimizer,
                                                   model_parameters=params, **kwargs)
    return engine, optimizer
