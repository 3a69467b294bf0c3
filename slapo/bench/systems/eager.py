"""``eager``: the HF model as is (Figure 9's Vanilla), data parallel over the ranks.

On one rank this is the plain model in a plain AdamW loop. On N ranks it is wrapped in
``DistributedDataParallel``: each rank trains on ``batch / N`` samples and the gradients are
averaged, so the losses (averaged over ranks) follow the single-rank run on the whole batch.
A checkpoint ratio above 0 checkpoints every layer (:func:`.base.checkpoint_every_layer`).
"""
from __future__ import annotations

import torch

from .base import NativeTrainer, build_hf_model, checkpoint_every_layer


def wrap_data_parallel(model, ctx):
    """DDP over all ranks when there are several (gloo on CPU, NCCL on CUDA)."""
    if ctx.world_size == 1:
        return model
    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)


class EagerSystem(NativeTrainer):
    mode = "eager"
    description = "the HF model as is (HF eager attention), data parallel over the ranks"

    def setup(self) -> None:
        model = build_hf_model(self.spec, self.ctx.device)
        if self.spec.ckpt:
            checkpoint_every_layer(model, self.notes)
        self.inner = model
        self.model = wrap_data_parallel(model, self.ctx)
        self.make_optimizer()

    def params_on_rank(self) -> int:
        return sum(p.numel() for p in self.inner.parameters())
