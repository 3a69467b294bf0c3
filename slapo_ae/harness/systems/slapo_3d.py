"""``slapo-megatron`` in 3D: an HF model + Slapo schedule over data x pipeline x tensor ranks,
for a case with pipeline stages (``pp`` > 1) or data-parallel replicas (``tp`` < GPUs / pp).

On every rank, with ``slapo.Topology(dp=, pp=, tp=)`` (tensor ranks consecutive, replicas
next, stages outermost, as Megatron-LM lays them out):

1. the zoo model is built from the seed and its family schedule applied over the topology's
   tensor group (:func:`slapo.model_schedule.schedule_model`: tensor parallelism with the
   vocabulary-sharded embedding and LM head, kernels, the case's checkpoint ratio), as
   ``slapo-megatron`` does over all ranks;
2. with pp > 1, the root is traced and cut (``cut_pipeline_stage``) after every
   ``layers / pp``-th layer (stage boundaries at layer boundaries, as even as the layer count
   allows), and ``slapo.build(sch, target="pipeline", topology=...)`` builds this rank's stage
   on ``torch.distributed.pipelining`` (GPipe, the case's micro-batches); the last stage
   computes the causal-LM loss as the vocabulary-parallel cross entropy of its logits
   (``slapo.op.cross_entropy.vocab_parallel_output_loss``: what ``vocab_parallel_loss``
   computed in the forward before tracing the root took it out; a plain cross entropy with
   tp = 1); ``PipelineBuild.step`` averages the gradients over the replicas. With pp = 1
   the scheduled model is wrapped in DDP over the data group.

Each replica trains on ``batch / dp`` samples of the global batch (``micro`` per micro-batch);
the step's loss is the mean of the last stage's micro-batch losses, broadcast along the
pipeline so that the harness's average over ranks is the global batch's loss. Throughput is
over the global batch. Families the pipeline splits here: :data:`LAYERS` (LLaMA, GPT-Neo);
others with pp > 1 are ``unsupported`` (the rules are in :mod:`.support`), as are fp16 (a
GradScaler cannot scale the loss inside the pipeline schedule's backward: use bf16) and more
stages than layers.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from .base import NativeTrainer
from .slapo_tp import schedule
from .support import PIPELINE_LAYERS

# Per family the schedule path of layer i (its layer count: support.PIPELINE_LAYERS).
LAYERS = {"llama": "model.layers.{}", "gpt_neo": "transformer.h.{}"}


def stage_cuts(layers: int, pp: int) -> list[int]:
    """The layers after which stages 0 .. pp-2 end: ``pp`` stages of ``layers // pp`` or one
    more layers (the later stages take the extra ones)."""
    return [(k + 1) * layers // pp - 1 for k in range(pp - 1)]


class Slapo3DSystem(NativeTrainer):
    mode = "slapo-megatron"
    description = ("HF model + Slapo schedule in 3D: tensor parallelism inside pipeline stages "
                   "(torch.distributed.pipelining), data parallel over replicas")

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
            self.pipe = None
            inner = slapo.build_module(sch)
            self.model = torch.nn.parallel.DistributedDataParallel(
                inner, process_group=topo.data_group,
                device_ids=[self.ctx.device.index] if self.ctx.device.type == "cuda" else None)
            self.notes.append("no pipeline (pp=1): DDP over each tensor rank's replicas")
        else:
            self.pipe = self._pipeline(sch)
            self.model = self.pipe.module
        self.make_optimizer()

    def _pipeline(self, sch):
        import slapo
        from slapo.op.cross_entropy import real_vocab_size, vocab_parallel_output_loss
        from slapo_ae.zoo import model_family, synthetic_batch

        case = self.spec.case
        config = sch.mod.config
        vocab_size = real_vocab_size(sch.mod)  # before tracing: the traced root has no head API
        family = model_family(case.model)
        path = LAYERS[family]
        cuts = stage_cuts(getattr(config, PIPELINE_LAYERS[family]), case.pp)
        example = synthetic_batch(config, case.micro_batch_size, case.seq_len,
                                  device=self.ctx.device, seed=case.seed)
        sch.trace(example_inputs={"input_ids": example["input_ids"],
                                  "attention_mask": example["attention_mask"]},
                  concrete_args={"use_cache": False, "return_dict": False})
        for layer in cuts:
            sch[path.format(layer)].cut_pipeline_stage()
        # the causal-LM loss on the last stage, over the tensor ranks' vocabulary slices of
        # the logits (the schedule's vocab_parallel_loss; a plain cross entropy with tp=1)
        loss = functools.partial(vocab_parallel_output_loss, kind="causal",
                                 group=self.topology.tensor_group,
                                 vocab_size=vocab_size)
        pipe, _ = slapo.build(sch, target="pipeline", topology=self.topology,
                              n_microbatches=case.n_microbatches, loss_fn=loss,
                              init_weights=False, device=self.ctx.device)
        self.notes.append(
            f"pipeline: {case.pp} stages cut after layers {', '.join(map(str, cuts))} "
            f"(torch.distributed.pipelining, GPipe, {case.n_microbatches} micro-batches of "
            f"{case.micro_batch_size}); the last stage computes the vocabulary-parallel cross "
            "entropy; gradients averaged over the replicas after the backward")
        return pipe

    # -- one step --------------------------------------------------------------------------
    def train_step(self, batch: dict) -> torch.Tensor:
        if self.pipe is None:
            return super().train_step(batch)
        with torch.autocast(self.ctx.device.type, dtype=self.autocast_dtype,
                            enabled=self.autocast_dtype is not None):
            losses = self.pipe.step(batch["input_ids"], batch["attention_mask"],
                                    target=batch["labels"])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        # the last stage has the losses; every stage reports them, so that the harness's mean
        # over ranks is the mean over replicas
        loss = (torch.stack(losses).mean().detach().float() if losses
                else torch.zeros((), device=self.ctx.device))
        dist.broadcast(loss, src=self.topology.ranks("pipe")[-1],
                       group=self.topology.pipeline_group)
        return loss
