"""Process groups for 3D parallelism: data x pipeline x tensor parallel ranks.

Ranks are laid out as Megatron-LM and DeepSpeed (``PipeModelDataParallelTopology``) lay them
out: tensor-parallel ranks are consecutive, data-parallel replicas come next, pipeline stages
are outermost::

    rank = (stage * dp + replica) * tp + tensor_rank

so that the ranks of one stage are a block and the tensor all-reduces, the most frequent
collectives, stay between neighbours (on one node, with GPUs). With dp=2, pp=2, tp=2 on 8
ranks: tensor groups [0, 1] [2, 3] [4, 5] [6, 7]; data groups [0, 2] [1, 3] [4, 6] [5, 7];
pipeline groups [0, 4] [1, 5] [2, 6] [3, 7]; stage 0 is ranks 0-3.

Use it as::

    topo = slapo.Topology(pp=2, tp=2)             # every rank, after init_process_group
    sch = slapo.create_schedule(model, group=topo.tensor_group)
    ...                                           # shard, trace, cut_pipeline_stage
    pipe, _ = slapo.build(sch, target="pipeline", topology=topo, n_microbatches=2,
                          loss_fn=loss_fn)
"""

from __future__ import annotations

import torch.distributed as dist


def rank_lists(*, dp: int = 1, pp: int = 1, tp: int = 1) -> dict[str, list[list[int]]]:
    """For each axis (``"data"``, ``"pipe"``, ``"tensor"``), the groups of ranks that
    communicate along it, in the layout above, plus ``"stage"``: the ranks of each stage."""
    _check_degrees(dp, pp, tp)

    def rank(d, p, t):
        return (p * dp + d) * tp + t

    return {
        "tensor": [[rank(d, p, t) for t in range(tp)] for p in range(pp) for d in range(dp)],
        "data": [[rank(d, p, t) for d in range(dp)] for p in range(pp) for t in range(tp)],
        "pipe": [[rank(d, p, t) for p in range(pp)] for d in range(dp) for t in range(tp)],
        "stage": [[rank(d, p, t) for d in range(dp) for t in range(tp)] for p in range(pp)],
    }


def _check_degrees(dp: int, pp: int, tp: int) -> None:
    for name, value in (("dp", dp), ("pp", pp), ("tp", tp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"topology {name} must be a positive int, got {value!r}")


class Topology:
    """This rank's place in a dp x pp x tp grid of ranks and its process groups.

    The degrees are keyword arguments (``Topology(dp=2, pp=2, tp=2)``). Constructing it is
    collective: every rank of the world creates it with the same degrees, in the same order
    as its other process groups (it calls ``dist.new_group`` for every group of every axis).
    ``dp * pp * tp`` must be the world size.

    Attributes:
        dp, pp, tp: the degrees (replicas, stages, tensor-parallel ranks).
        rank: this rank in the world.
        data_rank, stage_index, tensor_rank: this rank's coordinates.
        tensor_group: the ranks that shard one stage's layers (give it to
            ``create_schedule``); pipeline_group: one rank per stage, along which activations
            flow; data_group: the replicas of this rank's shard, whose gradients are averaged;
            stage_group: all ranks of this stage (dp * tp), over which build broadcasts the
            initial weights.
    """

    def __init__(self, *, dp: int = 1, pp: int = 1, tp: int = 1):
        _check_degrees(dp, pp, tp)
        if not dist.is_initialized():
            raise RuntimeError("slapo.Topology needs torch.distributed initialised "
                               "(init_process_group) on every rank")
        world = dist.get_world_size()
        if dp * pp * tp != world:
            raise ValueError(f"topology dp {dp} x pp {pp} x tp {tp} = {dp * pp * tp} ranks, but "
                             f"the world has {world}")
        self.dp, self.pp, self.tp = dp, pp, tp
        self.rank = dist.get_rank()
        self.tensor_rank = self.rank % tp
        self.data_rank = self.rank // tp % dp
        self.stage_index = self.rank // (tp * dp)
        self._ranks: dict[str, list[int]] = {}
        groups = {}
        for axis, lists in rank_lists(dp=dp, pp=pp, tp=tp).items():
            for ranks in lists:
                group = dist.new_group(ranks)  # collective: every rank creates every group
                if self.rank in ranks:
                    self._ranks[axis], groups[axis] = ranks, group
        self.tensor_group, self.pipeline_group = groups["tensor"], groups["pipe"]
        self.data_group, self.stage_group = groups["data"], groups["stage"]

    def ranks(self, axis: str) -> list[int]:
        """The world ranks of this rank's group along ``axis`` (``"data"``, ``"pipe"``,
        ``"tensor"`` or ``"stage"``)."""
        if axis not in self._ranks:
            raise ValueError(f"unknown topology axis {axis!r}; expected one of "
                             f"{', '.join(self._ranks)}")
        return list(self._ranks[axis])

    def get_dim(self, axis: str) -> int:
        """The degree along ``axis``, by DeepSpeed's axis names (``"data"``, ``"pipe"``,
        ``"model"``) or ours (``"tensor"``)."""
        dims = {"data": self.dp, "pipe": self.pp, "model": self.tp, "tensor": self.tp}
        if axis not in dims:
            raise ValueError(f"unknown topology axis {axis!r}; expected one of {', '.join(dims)}")
        return dims[axis]

    def __repr__(self) -> str:
        return (f"Topology(dp={self.dp}, pp={self.pp}, tp={self.tp}; rank {self.rank}: "
                f"replica {self.data_rank}, stage {self.stage_index}, "
                f"tensor rank {self.tensor_rank})")
