"""Upstream Slapo's helpers for DeepSpeed scripts: a DeepSpeed config (``get_ds_config``), the
process groups of a pipeline (``create_dist_group_for_pipeline``) and the ranks of tied
weights (``analyze_tie_ranks``, this dialect's form: the ranks and the stages)."""

from __future__ import annotations

import torch.distributed as dist

from ...pipeline import runtime
from ...topology import Topology

__all__ = ["analyze_tie_ranks", "create_dist_group_for_pipeline", "get_ds_config"]


def get_ds_config(batch_size: int, micro_batch_size_per_gpu: int, fp16: bool = True,
                  zero_stage: int = 0, desc: str = "", bf16: bool = False,
                  sequence_parallel: bool = False) -> dict:
    """A DeepSpeed configuration dict: AdamW (lr 1e-4), gradient clipping at 1.0, the batch
    sizes, fp16 (loss scale 2**12 to start) or bf16, and ZeRO at ``zero_stage`` (> 0) with
    overlapped, contiguous-free reduce-scatter; ``desc`` is kept as its ``help``."""
    config = {
        "help": desc,
        "steps_per_print": 10,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "fp16": {"enabled": fp16, "initial_scale_power": 12},
        "bf16": {"enabled": bf16},
        "gradient_clipping": 1.0,
        "train_batch_size": batch_size,
        "train_micro_batch_size_per_gpu": micro_batch_size_per_gpu,
        "pipeline": {"sequence_parallel": sequence_parallel},
        "wall_clock_breakdown": False,
    }
    if zero_stage > 0:
        config["zero_optimization"] = {"stage": zero_stage, "overlap_comm": True,
                                       "reduce_scatter": True, "contiguous_gradients": False,
                                       "prefetch_bucket_size": 5e8}
        config["zero_allow_untested_optimizer"] = True
    return config


def create_dist_group_for_pipeline(num_pp: int, num_mp: int) -> tuple[Topology, object]:
    """The topology of ``num_pp`` stages of ``num_mp`` tensor-parallel ranks over the world
    (the rest data parallel, in DeepSpeed's rank layout) and this rank's tensor-parallel
    group, to create the schedule with. Collective: every rank calls it.

    Returns a ``slapo.Topology`` (its ``get_dim`` speaks DeepSpeed's axis names) rather than
    DeepSpeed's ``PipeModelDataParallelTopology``: it holds the process groups that both
    pipelines take, ``build(sch, target="deepspeed", topology=...)`` (DeepSpeed's engine, as
    upstream) and ``build(sch, target="pipeline", topology=...)``
    (``torch.distributed.pipelining``)."""
    world = dist.get_world_size()
    if world % (num_pp * num_mp):
        raise ValueError(f"{num_pp} stages x {num_mp} tensor-parallel ranks do not divide the "
                         f"{world} ranks")
    topology = Topology(dp=world // (num_pp * num_mp), pp=num_pp, tp=num_mp)
    return topology, topology.tensor_group


def analyze_tie_ranks(tie_weights: list, topology) -> tuple[list, list]:
    """Upstream's DeepSpeed dialect's analysis of tied weights: for each group of
    ``(name, stage)`` holders (``slapo.pipeline.analyze_tie_weights``, either form's groups),
    the ranks that keep it equal, one sorted list per position within a stage, and the
    stages that hold it, sorted: ``(tie_ranks, tie_stages)`` (``slapo.pipeline``'s
    ``analyze_tie_ranks`` gives the first alone). A stage's ranks come from DeepSpeed's
    ``topology.filter_match(pipe=stage)``, or from a ``slapo.Topology``'s layout."""
    tie_stages = [sorted({stage for _, stage in holders}) for holders in tie_weights]
    if not hasattr(topology, "filter_match"):  # not DeepSpeed's ProcessTopology
        return runtime.analyze_tie_ranks(tie_weights, topology), tie_stages
    tie_ranks = [[sorted(ranks) for ranks in zip(*(topology.filter_match(pipe=k) for k in stages))]
                 for stages in tie_stages]
    return tie_ranks, tie_stages
