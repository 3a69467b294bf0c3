"""``deepspeed``: the plain HF model under DeepSpeed ZeRO stage 3 (the paper's DeepSpeed column).

Micro-batch = global batch / ranks, one micro-batch per step (no gradient accumulation). A
checkpoint ratio above 0 switches HF gradient checkpointing on for every layer (the paper's
"(1)"). The optimizer is ``torch.optim.AdamW`` (fused on CUDA, as for every system:
:func:`.base.adamw`) handed to DeepSpeed with ``zero_allow_untested_optimizer`` (DeepSpeed's
FusedAdam would need a compiled op, and on CPU there is none); ZeRO-3 steps it over its fp32
partitions. On CUDA, fp16/bf16 are DeepSpeed's own settings (16-bit parameters, fp32 master
weights in the optimizer, dynamic loss scaling for fp16).

DeepSpeed quirks met here (0.19.8), and what the harness does about them (:func:`quiet_deepspeed`):

- on CPU, ``initialize`` JIT-compiles a shared-memory all-reduce op into
  ``$TORCH_EXTENSIONS_DIR`` under a file lock; a run killed mid-build leaves the lock behind
  and every later run waits on it forever. The op serves only ``inference_all_reduce`` (which
  falls back to the process group without it), never training, so the harness marks it
  incompatible on CPU and nothing is compiled;
- ``initialize`` imports DeepSpeed's Muon optimizer (ZeRO's optimizer check and stage 3's
  constructor, the latter unconditionally), whose module applies ``torch.compile`` at import
  and so loads inductor: about 10 s per rank on 2 cores, paid by every ZeRO-3 launch. Left
  as is (stage 3 cannot do without the import).

The model is built on the CPU and partitioned by ``initialize``.
"""
from __future__ import annotations

import torch

from .base import System, adamw, build_hf_model, checkpoint_every_layer


def engine_config(batch_size: int, micro_batch: int, accumulation: int) -> dict:
    """What every DeepSpeed engine of the harness is configured with: its batch, in
    micro-batches, no gradient clipping (DeepSpeed clips the norm at 1.0 unless told
    otherwise, 0.19.8's default; no other system clips, and the comparison is about the
    schedule), and no logging of its own."""
    return {"train_batch_size": batch_size,
            "train_micro_batch_size_per_gpu": micro_batch,
            "gradient_accumulation_steps": accumulation,
            "gradient_clipping": 0.0,
            "steps_per_print": 1 << 30,
            "wall_clock_breakdown": False}


def ds_config(spec, micro_batch: int) -> dict:
    config = {**engine_config(spec.case.batch_size, micro_batch, 1),
              "zero_optimization": {"stage": 3},
              "zero_allow_untested_optimizer": True}
    if spec.case.device == "cuda" and spec.case.dtype == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    elif spec.case.device == "cuda" and spec.case.dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return config


SHM_OP = "deepspeed_shm_comm"


def quiet_deepspeed(device_type: str) -> None:
    """Skip DeepSpeed's CPU shared-memory op (see the module docstring)."""
    import deepspeed.ops

    if device_type == "cpu":
        deepspeed.ops.__compatible_ops__[SHM_OP] = False


class DeepSpeedZero3System(System):
    mode = "deepspeed"
    description = "HF model on DeepSpeed ZeRO-3, micro-batch = batch / ranks"

    def build(self) -> torch.nn.Module:
        """The model handed to DeepSpeed (the plain HF model here)."""
        model = build_hf_model(self.spec, "cpu")
        if self.spec.case.ckpt:
            checkpoint_every_layer(model, self.notes)
        return model

    def setup(self) -> None:
        quiet_deepspeed(self.ctx.device.type)
        self.model = self.build()
        self.optimizer = adamw(self.model.parameters(), self.spec.case.lr, self.ctx.device)
        self.engine = self.initialize(self.optimizer, ds_config(self.spec, self.micro_batch()))
        floating = {"fp16": torch.float16, "bf16": torch.bfloat16}
        self.input_dtype = (floating.get(self.spec.case.dtype) if self.spec.case.device == "cuda"
                            else None)

    def initialize(self, optimizer, config: dict):
        """The DeepSpeed engine of ``self.model``."""
        import deepspeed

        engine, _, _, _ = deepspeed.initialize(model=self.model, optimizer=optimizer,
                                               config=config)
        return engine

    def precision(self) -> str:
        if self.input_dtype is None:
            return "fp32"
        return (f"DeepSpeed {self.spec.case.dtype}: {self.spec.case.dtype} parameters, fp32 "
                "master weights in ZeRO-3's optimizer"
                + (", dynamic loss scaling" if self.spec.case.dtype == "fp16" else ""))

    def train_step(self, batch: dict) -> torch.Tensor:
        if self.input_dtype is not None:  # DeepSpeed runs the module itself in 16 bit
            batch = {k: v.to(self.input_dtype) if v.is_floating_point() else v
                     for k, v in batch.items()}
        loss = self.engine(**batch).loss
        self.engine.backward(loss)
        self.engine.step()
        return loss.detach().float()

    def params_on_rank(self) -> int:
        """Elements of this rank's ZeRO-3 partitions."""
        return sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel()
                   for p in self.model.parameters())
