"""``slapo-deepspeed`` (Slapo-ZeRO3): the HF model with its Slapo schedule (kernels and the
case's checkpoint ratio, no tensor parallelism), then DeepSpeed ZeRO-3 as in ``deepspeed``."""
from __future__ import annotations

import dataclasses

import torch

from .deepspeed_zero3 import DeepSpeedZero3System
from .slapo_tp import scheduled_model


class SlapoZero3System(DeepSpeedZero3System):
    mode = "slapo-deepspeed"
    description = "HF model + Slapo schedule (kernels, checkpoint ratio) on DeepSpeed ZeRO-3"

    def build(self):
        on_cpu = dataclasses.replace(self.ctx, device=torch.device("cpu"))  # DeepSpeed moves it
        return scheduled_model(self.spec, on_cpu, self.notes, trains_on=self.ctx.device,
                               tensor_parallel=False, shard_embedding=False, kernel_opt=True)
