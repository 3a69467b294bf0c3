"""The HF model without Slapo, data parallel over the ranks: ``eager`` (Figure 9's Vanilla)
and the two baselines a user would pick instead of Slapo on one GPU, ``hf-sdpa`` and
``hf-compile``.

| mode       | attention                          | compiled                          |
|------------|------------------------------------|-----------------------------------|
| eager      | HF eager                           | no                                |
| hf-sdpa    | HF ``sdpa``                        | no                                |
| hf-compile | HF ``sdpa`` (eager where HF has no | ``torch.compile`` (inductor) of   |
|            | SDPA: GPT-Neo), none in WideResNet | the whole model, default options  |

On one rank this is the model in a plain AdamW loop. On N ranks it is wrapped in
``DistributedDataParallel``: each rank trains on ``batch / N`` samples and the gradients are
averaged, so the losses (averaged over ranks) follow the single-rank run on the whole batch.
A checkpoint ratio above 0 checkpoints every layer (:func:`.base.checkpoint_every_layer`).
"""
from __future__ import annotations

import torch

from .base import NativeTrainer, build_hf_model, checkpoint_every_layer
from .support import NO_HF_SDPA


def wrap_data_parallel(model, ctx):
    """DDP over all ranks when there are several (gloo on CPU, NCCL on CUDA)."""
    if ctx.world_size == 1:
        return model
    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)


class EagerSystem(NativeTrainer):
    mode = "eager"
    description = "the HF model as is (HF eager attention), data parallel over the ranks"
    compiled = False

    def attn_implementation(self) -> str:
        return "eager"

    def setup(self) -> None:
        attention = self.attn_implementation()
        model = build_hf_model(self.spec, self.ctx.device, attention)
        if attention != "eager":
            self.notes.append(f"HF attention implementation: {attention}")
        if self.spec.case.ckpt:
            checkpoint_every_layer(model, self.notes)
        self.inner = model
        self.model = wrap_data_parallel(model, self.ctx)
        if self.compiled:
            # The first steps compile (the harness's warm-up steps absorb them).
            self.model = torch.compile(self.model)
            self.notes.append("torch.compile (inductor, default mode) of the whole model")
        self.make_optimizer(self.inner.parameters())

    def params_on_rank(self) -> int:
        return sum(p.numel() for p in self.inner.parameters())


class HFSdpaSystem(EagerSystem):
    mode = "hf-sdpa"
    description = "the HF model with HF's SDPA attention, data parallel over the ranks"

    def attn_implementation(self) -> str:
        return "sdpa"


class HFCompileSystem(EagerSystem):
    mode = "hf-compile"
    description = "the HF model (SDPA where HF has it) under torch.compile, data parallel"
    compiled = True

    def attn_implementation(self) -> str:
        from slapo_ae.zoo import model_family

        return "eager" if model_family(self.spec.case.model) in NO_HF_SDPA else "sdpa"
