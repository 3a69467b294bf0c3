"""The HF model without Slapo, data parallel over the ranks: ``eager`` (Figure 9's Vanilla)
and the baselines a user would pick instead of Slapo on one GPU, ``hf-sdpa``, ``hf-compile``
and ``hf-liger``.

| mode       | attention                          | kernels                            |
|------------|------------------------------------|------------------------------------|
| eager      | HF eager                           | PyTorch's                          |
| hf-sdpa    | HF ``sdpa``                        | PyTorch's                          |
| hf-compile | HF ``sdpa`` (eager where HF has no | ``torch.compile`` (inductor) of    |
|            | SDPA: GPT-Neo), none in WideResNet | the whole model, default options   |
| hf-liger   | HF ``sdpa``                        | liger-kernel's Triton kernels for  |
|            |                                    | the family, its patch's defaults   |

``hf-liger`` applies liger-kernel's own patch for the model's type
(``liger_kernel.transformers``' ``apply_liger_kernel_to_<type>(model=...)``, found in its
table ``MODEL_TYPE_TO_APPLY_LIGER_FN``) with the patch's defaults (for LLaMA: RMSNorm, RoPE,
SwiGLU and the fused linear cross entropy that never writes out the logits). A model type
liger-kernel has no patch for (BERT, GPT-Neo, OPT, T5) is ``unsupported`` with that reason,
decided in the parent from the table in liger-kernel's source before a rank starts
(:func:`.support.liger_model_types`), and so is any CPU case: liger-kernel's kernels are
Triton kernels for GPUs. It is an optional dependency (the ``gpu`` extra).

On one rank this is the model in a plain AdamW loop. On N ranks it is wrapped in
``DistributedDataParallel``: each rank trains on ``batch / N`` samples and the gradients are
averaged, so the losses (averaged over ranks) follow the single-rank run on the whole batch.
A checkpoint ratio above 0 checkpoints every layer (:func:`.base.checkpoint_every_layer`).
"""
from __future__ import annotations

import torch

from .base import NativeTrainer, build_hf_model, checkpoint_every_layer
from .support import NO_HF_SDPA, Unsupported, no_liger_kernels


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
        self.adapt(model)
        if self.spec.case.ckpt:
            checkpoint_every_layer(model, self.notes)
        self.inner = model
        self.model = wrap_data_parallel(model, self.ctx)
        if self.compiled:
            # The first steps compile (the harness's warm-up steps absorb them).
            self.model = torch.compile(self.model)
            self.notes.append("torch.compile (inductor, default mode) of the whole model")
        self.make_optimizer(self.inner.parameters())

    def adapt(self, model) -> None:
        """Change the built model before it is wrapped (hf-liger's kernels)."""

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


class HFLigerSystem(EagerSystem):
    mode = "hf-liger"
    description = "the HF model with liger-kernel's kernels for its family (SDPA attention)"

    def attn_implementation(self) -> str:
        return "sdpa"

    def setup(self) -> None:
        from slapo_ae.zoo import model_family

        # a family liger-kernel has no patch for is unsupported before the model is built
        liger_patch(model_family(self.spec.case.model))
        super().setup()

    def adapt(self, model) -> None:
        self.notes.append(apply_liger(model))


def liger_patch(model_type: str):
    """liger-kernel's patch for ``model_type`` (a transformers model type);
    :class:`Unsupported` when it has none."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    apply = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    if apply is None:
        raise Unsupported(no_liger_kernels(model_type, MODEL_TYPE_TO_APPLY_LIGER_FN))
    return apply


def apply_liger(model) -> str:
    """Apply liger-kernel's patch for ``model``'s type to the instance, with the patch's
    defaults; returns the record's note. :class:`Unsupported` when liger-kernel has none."""
    import importlib.metadata
    import inspect

    apply = liger_patch(model.config.model_type)
    defaults = [name for name, param in inspect.signature(apply).parameters.items()
                if param.default is True]
    apply(model=model)
    version = importlib.metadata.version("liger-kernel")
    return f"liger-kernel {version}: {apply.__name__}(model=...), on: {', '.join(defaults)}"
