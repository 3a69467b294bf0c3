"""``slapo-deepspeed`` (Slapo-ZeRO3): the HF model with its Slapo schedule (kernels and the
case's checkpoint ratio, no tensor parallelism), handed to DeepSpeed ZeRO-3 by
``slapo.build(sch, target="deepspeed")`` with the configuration of ``deepspeed``. On CUDA
the schedule compiles each layer, as Slapo-TP's does, and the build makes each compiled layer
a ZeRO-3 leaf module (``slapo.engines.with_zero3_leaves``), as every transformer layer is,
compiled or not, so that ZeRO-3 gathers a layer's parameters at once, and keeps torch's own
linear in them (``slapo.engines.with_torch_linear``: DeepSpeed's memory-efficient one left
compiled Linear layers with a bias without gradients with torch 2.11)."""
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
        self.schedule = schedule(self.spec, on_cpu, self.notes, trains_on=self.ctx.device,
                                 tensor_parallel=False, shard_embedding=False, kernel_opt=True)
        return self.schedule.mod

    def initialize(self, optimizer, config: dict):
        """DeepSpeed's engine through Slapo's own build (the weights are the zoo model's)."""
        import slapo
        from slapo.engines import with_torch_linear, zero3_leaves

        if with_torch_linear(self.schedule.mod, config) is not config:  # what the build does
            self.notes.append("ZeRO-3 memory-efficient linear off: compiled regions run "
                              "torch's linear (slapo.engines.with_torch_linear)")
        leaves, refused = zero3_leaves(self.schedule.mod, layers=True)
        if leaves:
            self.notes.append(f"ZeRO-3 leaf modules: {len(leaves)}, the transformer layers "
                              "and compiled regions (slapo.engines.with_zero3_leaves): each "
                              "gathers its parameters at once, its modules add no hooks")
        for name, why in refused.items():
            self.notes.append(f"no ZeRO-3 leaf: {name}: {why}")
        engine, _ = slapo.build(self.schedule, target="deepspeed", init_weights=False,
                                config=config, optimizer=optimizer, zero3_layer_leaves=True)
        return engine
