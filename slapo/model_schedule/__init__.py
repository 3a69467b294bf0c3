"""Schedules of the paper's models, one module per family, behind one entry point.

    model = build_model("bert-large-uncased")
    sch = slapo.create_schedule(model)
    schedule_model(sch, "bert-large-uncased", kernel_opt=True, ckpt_ratio=0.5)
    model = slapo.build(sch)

Options (each family honours all of them):
  tensor_parallel  shard attention heads and the FFN over ``sch``'s group (Megatron style);
  shard_embedding  with tensor_parallel, shard the word embedding by vocabulary as well;
  kernel_opt       fused kernels: attention through ``scaled_dot_product_attention``, fused
                   bias+GeLU where the model has one;
  ckpt_ratio       checkpoint the first ``round(ratio * layers)`` layers.
The scheduled model is called exactly like the plain one and returns its loss the same way.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ScheduleOptions:
    tensor_parallel: bool = True
    shard_embedding: bool = True
    kernel_opt: bool = True
    ckpt_ratio: float = 0.0

    def __post_init__(self):
        if not 0.0 <= self.ckpt_ratio <= 1.0:
            raise ValueError(f"ckpt_ratio must lie in [0, 1], got {self.ckpt_ratio}")


def checkpoint_layers(sch, layer_paths: list[str], ratio: float) -> int:
    """Checkpoint the first ``round(ratio * len(layer_paths))`` layers; returns how many."""
    count = round(ratio * len(layer_paths))
    for path in layer_paths[:count]:
        sch[path].checkpoint()
    return count


def _family_schedules():
    from . import bert
    return {"bert": bert.schedule}


def schedule_model(sch, name: str, **options) -> ScheduleOptions:
    """Apply the schedule of model ``name`` (a zoo name or a family) to the root schedule
    ``sch``; returns the options used."""
    from ..models import FAMILIES, model_family

    family = name if name in FAMILIES else model_family(name)
    opts = ScheduleOptions(**options)
    schedules = _family_schedules()
    if family not in schedules:
        raise NotImplementedError(f"no schedule for the {family} family yet "
                                  f"(scheduled families: {', '.join(sorted(schedules))})")
    schedules[family](sch, opts)
    return opts
