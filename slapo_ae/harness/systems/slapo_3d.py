"""``slapo-megatron`` in 3D: an HF model + Slapo schedule over data x pipeline x tensor ranks,
for a case with pipeline stages (``pp`` > 1) or data-parallel replicas (``tp`` < GPUs / pp).

On every rank, with ``slapo.Topology(dp=, pp=, tp=)`` (tensor ranks consecutive, replicas
next, stages outermost, as Megatron-LM and DeepSpeed lay them out):

1. the zoo model is built from the seed and its family schedule applied over the topology's
   tensor group (:func:`slapo.model_schedule.schedule_model`: tensor parallelism with the
   vocabulary-sharded embedding and LM head, kernels, the case's checkpoint ratio), as
   ``slapo-megatron`` does over all ranks;
2. with pp > 1, the root is traced and cut (``cut_pipeline_stage``) after every
   ``layers / pp``-th layer (stage boundaries at layer boundaries, as even as the layer count
   allows), and ``slapo.build(sch, target="deepspeed", topology=..., config=...,
   loss_fn=...)`` builds this rank's stage on DeepSpeed's pipeline engine, as the paper's
   Slapo ran its pipelines: 1F1B over the case's micro-batches (``engine.train_batch``),
   gradients averaged over the replicas and tied weights summed over their stages by the
   engine, then its optimizer step. The last stage computes the causal-LM loss as the
   vocabulary-parallel cross entropy of its logits
   (``slapo.op.cross_entropy.vocab_parallel_output_loss``: what ``vocab_parallel_loss``
   computed in the forward before tracing the root took it out; a plain cross entropy with
   tp = 1). With pp = 1 the scheduled model is wrapped in DDP over the data group.

Precision and optimizer are the other systems': AdamW over fp32 parameters (DeepSpeed steps
the torch optimizer it is given, with ZeRO off and no clipping), under ``torch.autocast`` in
bf16 on CUDA: DeepSpeed's own ``torch_autocast`` section (around its forward DeepSpeed turns
off an autocast it finds on unless that section is on), with no module whose gradients it
would reduce in bf16, so that they are reduced in fp32 as the other systems'. Each replica
trains on ``batch / dp`` samples of the global batch (``micro`` per micro-batch); the step's
loss is DeepSpeed's: the mean of the last stage's micro-batch losses over the replicas,
broadcast along the pipeline, so that the harness's average over ranks is the global batch's
loss. Throughput is over the global batch. Families the pipeline splits here: LLaMA and
GPT-Neo (``support.PIPELINE_LAYERS``, those megatron-core's GPT pipelines too; their layers
found as ``apply_schedule`` finds them); others with pp > 1 are ``unsupported`` (the rules are in
:mod:`.support`), as are fp16 (autocast in fp16 needs a loss scaler that the stages agree
on, which the harness's torch-native systems do not have inside a pipeline: use bf16) and
more stages than layers.
"""
from __future__ import annotations

import functools

import torch

from .base import NativeTrainer, adamw
from .deepspeed_zero3 import engine_config, quiet_deepspeed
from .slapo_tp import schedule
from .support import PIPELINE_LAYERS


def stage_cuts(layers: int, pp: int) -> list[int]:
    """The layers after which stages 0 .. pp-2 end: ``pp`` stages of ``layers // pp`` or one
    more layers (the later stages take the extra ones)."""
    return [(k + 1) * layers // pp - 1 for k in range(pp - 1)]


class Slapo3DSystem(NativeTrainer):
    mode = "slapo-megatron"
    description = ("HF model + Slapo schedule in 3D: tensor parallelism inside pipeline stages "
                   "(DeepSpeed's pipeline engine, 1F1B), data parallel over replicas")

    # -- how the global batch is split --------------------------------------------------
    @property
    def dp_size(self) -> int:
        return self.spec.case.dp_size

    @property
    def dp_rank(self) -> int:
        return self.topology.data_rank

    @property
    def tp_size(self) -> int:
        return self.spec.case.tp_size

    def info(self) -> dict:
        case = self.spec.case
        return {**super().info(), "pp_size": case.pp, "micro_batch": case.micro_batch_size,
                "n_microbatches": case.n_microbatches}  # precision and optimizer as the base's

    # -- building ------------------------------------------------------------------------
    def setup(self) -> None:
        import slapo

        case = self.spec.case
        self.topology = topo = slapo.Topology(dp=case.dp_size, pp=case.pp, tp=case.tp_size)
        sch = schedule(self.spec, self.ctx, self.notes, topology=topo, tensor_parallel=True,
                       shard_embedding=True, kernel_opt=True)
        self.notes.append(f"Slapo 3D: {topo.dp} replicas x {topo.pp} stages x {topo.tp} tensor "
                          "ranks (slapo.Topology; tensor ranks consecutive, stages outermost)")
        if case.pp == 1:
            self.engine = None
            inner = slapo.build_module(sch)
            self.model = torch.nn.parallel.DistributedDataParallel(
                inner, process_group=topo.data_group,
                device_ids=[self.ctx.device.index] if self.ctx.device.type == "cuda" else None)
            self.notes.append("no pipeline (pp=1): DDP over each tensor rank's replicas")
            self.make_optimizer()
        else:
            self.engine = self._pipeline(sch)
            self.model = self.engine.module

    def _pipeline(self, sch):
        import slapo
        from slapo.model_schedule.api import layer_list_path
        from slapo.op.cross_entropy import real_vocab_size, vocab_parallel_output_loss
        from slapo_ae.zoo import model_family, synthetic_batch

        case = self.spec.case
        config = sch.mod.config
        vocab_size = real_vocab_size(sch.mod)  # before tracing: the traced root has no head API
        family = model_family(case.model)
        path = layer_list_path(sch.mod, family)  # of the layers, as apply_schedule cuts them
        cuts = stage_cuts(getattr(config, PIPELINE_LAYERS[family]), case.pp)
        example = synthetic_batch(config, case.micro_batch_size, case.seq_len,
                                  device=self.ctx.device, seed=case.seed)
        sch.trace(example_inputs={"input_ids": example["input_ids"],
                                  "attention_mask": example["attention_mask"]},
                  concrete_args={"use_cache": False, "return_dict": False})
        for layer in cuts:
            sch[f"{path}.{layer}"].cut_pipeline_stage()
        # the causal-LM loss on the last stage, over the tensor ranks' vocabulary slices of
        # the logits (the schedule's vocab_parallel_loss; a plain cross entropy with tp=1)
        loss = functools.partial(vocab_parallel_output_loss, kind="causal",
                                 group=self.topology.tensor_group,
                                 vocab_size=vocab_size)
        quiet_deepspeed(self.ctx.device.type)
        engine, self.optimizer = slapo.build(
            sch, target="deepspeed", topology=self.topology, config=pipeline_config(case),
            loss_fn=loss, init_weights=False,
            optimizer=lambda params: adamw(params, case.lr, self.ctx.device))
        self.set_precision()  # no scaler: fp16 with pipeline stages is unsupported (.support)
        self.notes.append(
            f"pipeline: {case.pp} stages cut after layers {', '.join(map(str, cuts))} "
            f"(DeepSpeed's pipeline engine, 1F1B, {case.n_microbatches} micro-batches of "
            f"{case.micro_batch_size}); the last stage computes the vocabulary-parallel cross "
            "entropy; DeepSpeed averages the gradients over the replicas and sums the tied "
            "weights' over their stages")
        return engine

    # -- one step --------------------------------------------------------------------------
    def train_step(self, batch: dict) -> torch.Tensor:
        if self.engine is None:
            return super().train_step(batch)
        size = self.spec.case.micro_batch_size
        micro_batches = [((batch["input_ids"][k:k + size], batch["attention_mask"][k:k + size]),
                          batch["labels"][k:k + size])
                         for k in range(0, batch["input_ids"].shape[0], size)]
        # every rank gets the step's loss: the replicas' mean, broadcast along the pipeline
        loss = self.engine.train_batch(iter(micro_batches))  # autocast: pipeline_config
        return loss.detach().float()


def pipeline_config(case) -> dict:
    """DeepSpeed's configuration of a case's pipeline: the harness's engine settings
    (``engine_config``: its micro-batches, no clipping), ZeRO off (the optimizer steps fp32
    parameters, as the torch-native systems'), and on CUDA in bf16 the forward under torch's
    autocast (see the module docstring)."""
    config = engine_config(case.batch_size, case.micro_batch_size, case.n_microbatches)
    if case.device == "cuda" and case.dtype == "bf16":
        config["torch_autocast"] = {"enabled": True, "dtype": "bf16",
                                    "lower_precision_safe_modules": []}
    return config
