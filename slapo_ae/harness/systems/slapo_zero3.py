"""``slapo-deepspeed`` (Slapo-ZeRO3): the HF model with its Slapo schedule (kernels and the
case's checkpoint ratio, no tensor parallelism), handed to DeepSpeed ZeRO-3 by
``slapo.build(sch, target="deepspeed")`` with the configuration of ``deepspeed``."""
from __future__ import annotations

import dataclasses

import torch

from .deepspeed_zero3 import DeepSpeedZero3System
from .slapo_tp import schedule


class SlapoZero3System(DeepSpeedZero3System):
    mode = "slapo-deepspeed"
    description = "HF model + Slapo schedule (kernels, checkpoint ratio) on DeepSpeed ZeRO-3"

    def build(self):
        on_cpu = dataclasses.replace(self.ctx, device=torch.device("cpu"))  # DeepSpeed moves it
        # No compiled layers: ZeRO-3 gathers each module's parameters in hooks it adds at
        # initialize, which a region compiled from the schedule's modules would not run.
        self.schedule = schedule(self.spec, on_cpu, self.notes, trains_on=self.ctx.device,
                                 tensor_parallel=False, shard_embedding=False, kernel_opt=True,
                                 compile_layers=False)
        if self.ctx.device.type == "cuda":
            self.notes.append("Slapo-ZeRO3 compiles no layers: ZeRO-3 gathers each module's "
                              "parameters in hooks that a compiled layer would not run")
        return self.schedule.mod

    def initialize(self, optimizer, config: dict):
        """DeepSpeed's engine through Slapo's own build (the weights are the zoo model's)."""
        import slapo

        engine, _ = slapo.build(self.schedule, target="deepspeed", init_weights=False,
                                config=config, optimizer=optimizer)
        return engine
