"""Running pipeline stages: the ranks that hold tied weights, gradient reduction, and the
build on ``torch.distributed.pipelining`` (``PipelineStage`` and a schedule such as
``ScheduleGPipe``, which runs them).

``build_pipeline`` builds this rank's stage of ``partition.split_stages``: one stage per rank
of a group, or, with a ``slapo.Topology``, 3D parallelism (tensor-parallel stages,
data-parallel replicas). A parameter that several stages hold (tied weights) is a ``Tie``:
its copies start equal and their gradients are summed over the stages that hold them.
``analyze_tie_weights`` and ``analyze_tie_ranks`` are upstream Slapo's analyses of the same
ties, by parameter name and by rank.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from .. import state
from ..topology import Topology, rank_lists
from .partition import shared_parameters, split_stages


@dataclass
class Tie:
    """A parameter of this rank's stage that other stages hold too (tied weights): its
    copies are kept equal over ``group`` (this pipeline's ranks of the stages that hold it),
    starting from the value on rank ``src`` (the first of them)."""
    param: torch.nn.Parameter
    group: Any
    src: int


@dataclass
class PipelineBuild:
    """What ``build(sch, target="pipeline")`` returns on each rank.

    ``schedule`` is the ``torch.distributed.pipelining`` schedule (it runs the pipeline),
    ``stage`` its ``PipelineStage``, ``module`` this rank's stage module (give its parameters
    to the optimizer). ``step`` calls ``schedule.step`` with the arguments each rank needs.
    ``topology`` is the ``slapo.Topology`` it was built with (None: one stage per rank of one
    group); ``ties`` this stage's parameters that other stages hold too.
    """
    schedule: Any
    stage: Any
    module: fx.GraphModule
    stage_index: int
    num_stages: int
    topology: Any = None
    ties: list[Tie] = field(default_factory=list)

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def step(self, *inputs, target=None, **kw_inputs) -> list[torch.Tensor]:
        """One training step over this replica's batch: the first stage takes ``inputs``
        (and ``kw_inputs``, by the traced model's argument names), the last ``target``; then,
        with data parallelism, the gradients are averaged over the replicas
        (``reduce_gradients``). Returns the per-microbatch losses on the last stage (else
        [])."""
        losses: list[torch.Tensor] = []
        kwargs = {"target": target, "losses": losses} if self.is_last else {}
        if self.is_first:
            self.schedule.step(*inputs, **kw_inputs, **kwargs)
        else:
            self.schedule.step(**kwargs)
        self.reduce_gradients()
        return losses

    def reduce_gradients(self) -> None:
        """Sum the gradients of tied parameters over the stages that hold them, then average
        this stage's gradients over the data-parallel replicas. ``step`` calls it; call it
        yourself after ``schedule.step``.

        One all-reduce of all gradients of a dtype, flattened, after the pipeline's backward
        (rather than DDP on the stage module, whose bucketed hooks the pipeline's per-stage
        backward would have to drive): simple, and the same in every schedule."""
        for tie in self.ties:  # each holder has the gradient of its own uses
            if tie.param.grad is None:
                tie.param.grad = torch.zeros_like(tie.param)
            dist.all_reduce(tie.param.grad, group=tie.group)
        topo = self.topology
        if topo is None or topo.dp == 1:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for param in self.module.parameters():
            if param.grad is not None:
                by_dtype.setdefault(param.grad.dtype, []).append(param.grad)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=topo.data_group)
            flat /= topo.dp
            for grad, part in zip(grads, flat.split([g.numel() for g in grads])):
                grad.copy_(part.view_as(grad))

    def sync_tied_weights(self) -> None:
        """Give every copy of a tied parameter the first holder's value (``build`` calls it
        once the weights are initialised)."""
        sync_ties(self.ties)


def sync_ties(ties: list[Tie]) -> None:
    """Give each ``Tie``'s parameter its first holder's value (on every rank of its group)."""
    with torch.no_grad():
        for tie in ties:
            dist.broadcast(tie.param.data, src=tie.src, group=tie.group)


def build_pipeline(sch, n_microbatches: int, loss_fn: Callable | None = None,
                   schedule: str | type = "GPipe", group=None, device=None,
                   stage_index: int | None = None, topology=None) -> PipelineBuild:
    """Split the traced model at its cuts and build this rank's stage and schedule.

    Without ``topology``, every rank of ``group`` (default: the schedule's group) is one
    stage, in rank order (``stage_index`` overrides this rank's). With a ``slapo.Topology``,
    the schedule's group must be the topology's tensor group (the model was sharded over
    it); the cuts make ``topology.pp`` stages, this rank builds stage
    ``topology.stage_index`` in its pipeline group, and ``PipelineBuild.step`` averages the
    gradients over its data group.

    ``loss_fn(output, target)`` runs on the last stage, whose output is the model's, except
    that a mapping (a transformers ``ModelOutput``) comes as its tensor, or the tuple of its
    tensors (``tensors_of``: the pipeline passes tensors only); without it, the loss the schedule
    took from the model when its root was traced (``slapo.op.vocab_parallel_loss``: the
    vocabulary-parallel cross entropy of the sharded logits), if any.
    """
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    if not dist.is_initialized():
        raise RuntimeError("build(target='pipeline') needs torch.distributed initialised, one "
                           "rank per stage")
    stages = split_stages(sch, tied=True)
    for k, stage in enumerate(stages[1:], 1):
        name = embedded_input(stage)
        if name is not None:
            raise ValueError(f"pipeline stage {k} looks its input '{name}' up in an embedding: "
                             "torch.distributed.pipelining runs a later stage once on "
                             "uninitialised inputs to learn its shapes, which such a lookup "
                             "cannot take (T5's decoder stages); build(sch, target='deepspeed', "
                             "topology=, config=, loss_fn=) runs this pipeline on DeepSpeed's "
                             "engine")
    if loss_fn is None:
        loss_fn = state.pipeline_loss(sch.root)
    if topology is not None:
        if group is not None or stage_index is not None:
            raise ValueError("build(target='pipeline'): pass topology= or group=/stage_index=, "
                             "not both (the topology has the pipeline groups)")
        if not isinstance(topology, Topology):
            raise TypeError(f"topology= takes a slapo.Topology, got {type(topology).__name__} "
                            "(for DeepSpeed's PipeModelDataParallelTopology, create "
                            "slapo.Topology(dp=, pp=, tp=) with its degrees: it makes the "
                            "process groups)")
        _check_tensor_group(sch.root, topology)
        group, rank, world = topology.pipeline_group, topology.stage_index, topology.pp
        where = f"a topology with pp={world}"
        stage_ranks = topology.ranks("pipe")
    else:
        group = group if group is not None else sch.root.group
        world = dist.get_world_size(group)
        rank = dist.get_rank(group) if stage_index is None else stage_index
        where = f"{world} ranks; a pipeline without topology= needs one rank per stage"
        stage_ranks = dist.get_process_group_ranks(group) if group is not None \
            else list(range(world))
    if len(stages) != world:
        raise ValueError(f"{len(stages)} pipeline stages ({len(stages) - 1} cuts) for {where}")
    module = stages[rank]
    if rank == world - 1:
        _plain_last_output(module)
    ties = _ties(shared_parameters(stages), rank, stage_ranks, group, module)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) \
            if torch.cuda.is_available() else torch.device("cpu")
    stage = PipelineStage(module, rank, world, device, group=group)
    cls = get_schedule_class(schedule) if isinstance(schedule, str) else schedule
    sched = cls(stage, n_microbatches=n_microbatches, loss_fn=loss_fn)
    return PipelineBuild(sched, stage, module, rank, world, topology, ties)


def embedded_input(module: fx.GraphModule) -> str | None:
    """The name of an input of ``module`` that an ``nn.Embedding`` looks up, directly or in a
    traced submodule it is passed to; None if there is none."""
    def looked_up(gm: fx.GraphModule, value: fx.Node) -> bool:
        for user in value.users:
            if user.op != "call_module":
                continue
            sub = gm.get_submodule(user.target)
            if isinstance(sub, nn.Embedding) and user.args[:1] == (value,):
                return True
            if isinstance(sub, fx.GraphModule):  # called with its inputs in order, or by name
                inputs = [n for n in sub.graph.nodes if n.op == "placeholder"]
                passed = [inputs[i] for i, a in enumerate(user.args)
                          if a is value and i < len(inputs)]
                passed += [n for n in inputs if user.kwargs.get(n.target) is value]
                if any(looked_up(sub, n) for n in passed):
                    return True
        return False

    return next((n.name for n in module.graph.nodes
                 if n.op == "placeholder" and looked_up(module, n)), None)


def tensors_of(output):
    """The last stage's output as ``torch.distributed.pipelining`` takes it: a mapping (a
    transformers ``ModelOutput``) becomes its one tensor, or the tuple of its tensors in order
    (as ``return_dict=False`` gives them); anything else is kept."""
    if not isinstance(output, Mapping):
        return output
    values = tuple(value for value in output.values() if value is not None)
    return values[0] if len(values) == 1 else values


def _plain_last_output(module: fx.GraphModule) -> None:
    """Make the last stage return ``tensors_of`` its output (the pipeline carries tensors)."""
    output = next(n for n in reversed(module.graph.nodes) if n.op == "output")
    with module.graph.inserting_before(output):
        plain = module.graph.call_function(tensors_of, (output.args[0],))
    output.args = (plain,)
    module.recompile()


def _ties(shared, stage_index: int, stage_ranks: list[int], group, module) -> list[Tie]:
    """This stage's ``Tie``s. A tie of every stage uses the pipeline's group; one of some
    stages a group of their ranks, created by its members only, in the same order on all
    (``shared`` is the same everywhere)."""
    groups: dict[tuple[int, ...], Any] = {}
    ties = []
    for holders in shared:
        stages = tuple(k for k, _ in holders)
        if stage_index not in stages:
            continue
        ranks = [stage_ranks[k] for k in stages]
        if stages not in groups:
            groups[stages] = group if len(stages) == len(stage_ranks) else \
                dist.new_group(ranks, use_local_synchronization=True)
        ties.append(Tie(module.get_parameter(dict(holders)[stage_index]), groups[stages],
                        src=ranks[0]))
    return ties


def _check_tensor_group(root, topology) -> None:
    """The schedule must have been sharded over the topology's tensor group."""
    def ranks(group):
        return dist.get_process_group_ranks(group) if group is not None \
            else list(range(dist.get_world_size()))
    have, want = ranks(root.group), ranks(topology.tensor_group)
    if have != want:
        raise ValueError(f"the schedule's group has ranks {have}, but {topology!r} has the "
                         f"tensor group {want}: create the schedule with "
                         "create_schedule(model, group=topology.tensor_group)")


def analyze_tie_weights(model: nn.Module, is_pipeline_partitioned: bool | None = None):
    """Upstream Slapo's analysis of tied weights, in both of its forms.

    ``analyze_tie_weights(model)`` (upstream's first form): each parameter that modules of
    more than one stage hold, as its holders ``(parameter name, stage index)``. The stages
    are ``model``'s children in order (the stage modules of a partition, ``submod_0`` ...;
    in a model cut between its children, the children), and a name is the parameter's full
    path in ``model``. Groups in the order of their first holder::

        [[("stage0.wte.weight", 0), ("stage1.linear.weight", 1)]]

    ``analyze_tie_weights(model, is_pipeline_partitioned)`` (upstream's later form): a dict
    from each tied parameter to its holders. Partitioned (True): the stages as above, the
    parameters that several stages hold, each holder named within its stage
    (``("linear.weight", 1)``). Not partitioned (False): every parameter reached by more than
    one path in ``model``, each path with stage 0 (``("stage1.linear.weight", 0)``).
    """
    if is_pipeline_partitioned is None:
        names = [name for name, _ in model.named_children()]
        return [[(f"{names[k]}.{name}", k) for k, name in holders]
                for holders in shared_parameters(list(model.children()))]
    if is_pipeline_partitioned:
        stages = list(model.children())
        return {stages[holders[0][0]].get_parameter(holders[0][1]):
                [(name, k) for k, name in holders]
                for holders in shared_parameters(stages)}
    paths: dict[int, tuple[nn.Parameter, list[str]]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        paths.setdefault(id(param), (param, []))[1].append(name)
    return {param: [(name, 0) for name in names]
            for param, names in paths.values() if len(names) > 1}


def analyze_tie_ranks(tie_weights: list, topology) -> list[list[list[int]]]:
    """The groups of ranks that keep each tied weight equal (upstream Slapo's analysis): for
    each group of ``analyze_tie_weights``, one list of world ranks per position within a
    stage (data-parallel replica x tensor-parallel rank), holding that position's rank of
    each stage that holds the weight, sorted. ``topology`` is a ``slapo.Topology`` or
    DeepSpeed's ``PipeModelDataParallelTopology`` (the same rank layout: pipe, data, model)."""
    stage_ranks = rank_lists(dp=topology.get_dim("data"), pp=topology.get_dim("pipe"),
                             tp=topology.get_dim("model"))["stage"]
    groups = []
    for holders in tie_weights:
        stages = sorted({stage for _, stage in holders})
        if stages[-1] >= len(stage_ranks):
            raise ValueError(f"tied weight {sorted(holders)[0][0]!r} is held by stage "
                             f"{stages[-1]}, but the topology has {len(stage_ranks)} stages")
        groups.append([sorted(ranks) for ranks in zip(*(stage_ranks[k] for k in stages))])
    return groups
