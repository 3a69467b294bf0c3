"""Slapo schedules trained in a Megatron-style loop: ``slapo-megatron`` (Slapo-TP) and the
Figure 9 ablation steps ``slapo-kernel``, ``slapo-tp-attn-ffn``, ``slapo-tp-full``.

The HF model is built with the same seed on every rank, scheduled with
:func:`slapo.model_schedule.schedule_model` and trained with AdamW:

| mode               | tensor parallel   | shard embedding | kernel opt | batch per rank |
|--------------------|-------------------|-----------------|------------|----------------|
| slapo-megatron     | over all ranks    | yes             | yes        | whole batch    |
| slapo-tp-full      | over all ranks    | yes             | yes        | whole batch    |
| slapo-tp-attn-ffn  | over all ranks    | no              | yes        | whole batch    |
| slapo-kernel       | no (DDP if N > 1) | -               | yes        | batch / N      |

The checkpoint ratio of the case goes to the schedule (the first ``round(ratio * layers)``
layers are checkpointed). Under bf16 without data parallelism the whole model trains in bf16
with fp32 master copies and no autocast (:func:`slapo_master_weights`, :mod:`.master_weights`). A
family without a schedule is ``unsupported``. A ``slapo-megatron`` case with pipeline stages
or data-parallel replicas (``pp=``, ``tp=``) runs under :mod:`.slapo_3d`.
"""
from __future__ import annotations

from .base import NativeTrainer, TensorParallelTrainer, Unsupported, build_hf_model
from .eager import wrap_data_parallel


def has_fused_bias_gelu(model) -> bool:
    """Whether a schedule put a fused bias+GeLU in ``model``: the node the families' ``fuse``
    (BERT, RoBERTa: a module) or ``replace`` (GPT-Neo: a call) leaves in a traced graph is
    named ``bias_gelu``."""
    import torch.fx

    return any(node.name.startswith("bias_gelu")
               for mod in model.modules() if isinstance(getattr(mod, "graph", None), torch.fx.Graph)
               for node in mod.graph.nodes)


def scheduled_model(spec, ctx, notes: list[str], trains_on=None, **options):
    """The zoo model with its Slapo schedule applied (:func:`schedule`), built as a module."""
    import slapo

    return slapo.build_module(schedule(spec, ctx, notes, trains_on, **options))


def schedule(spec, ctx, notes: list[str], trains_on=None, topology=None, **options):
    """Build the zoo model on this rank's device and apply its Slapo schedule; returns the
    schedule. ``notes`` gets the kernels the schedule's ops pick on the device it trains on
    (``trains_on``, default ``ctx.device``; see ``slapo.op.kernel_choices``). With a
    ``slapo.Topology`` (:mod:`.slapo_3d`) the schedule shards over its tensor group, else
    over all ranks."""
    import slapo
    from slapo.model_schedule import schedule_model
    from slapo.op import CoreAttention, PaddedLinear, kernel_choices, vocab_projection_kernel
    from slapo.op.cross_entropy import padded_vocab_spec
    from slapo.random import manual_seed

    model = build_hf_model(spec, ctx.device)
    tensor_rank = topology.tensor_rank if topology is not None else ctx.rank
    manual_seed(spec.case.seed, tensor_rank if options.get("tensor_parallel") else 0)
    sch = slapo.create_schedule(model, group=topology.tensor_group if topology else None)
    ratio = float(spec.case.ckpt or 0.0)
    device = (trains_on or ctx.device).type
    try:
        opts = schedule_model(sch, ckpt_ratio=ratio, device=device, **options)
    except NotImplementedError as err:
        raise Unsupported(f"no Slapo schedule: {err}") from None
    if opts.kernel_opt:
        choices = kernel_choices(device, local_window=any(
            isinstance(mod, CoreAttention) and mod.window is not None
            for mod in sch.mod.modules()))
        if opts.compile_layers:
            choices["bias_gelu"] = "in the layer's region"
            choices["layers"] = ("one torch.compile (inductor) region each: norms, residual "
                                 "adds, dropout, rotary, activations fused; matmuls on cuBLAS")
            vocab_parallel = (options.get("tensor_parallel") and options.get("shard_embedding")
                              and sch.world_size > 1)
            choices["loss"] = ("vocabulary-parallel cross entropy" if vocab_parallel else
                               "cross entropy in one torch.compile region (float32)")
        else:
            choices["layers"] = "eager" + (" (compiling is off on CPU: seconds per layer)"
                                           if device == "cpu" else "")
            if not has_fused_bias_gelu(sch.mod):
                choices["bias_gelu"] = "none (the model's own Linear and activation)"
        if any(isinstance(mod, PaddedLinear) for mod in sch.mod.modules()):
            choices["vocabulary projection"] = vocab_projection_kernel(device)
        notes.append(f"Slapo kernels on {device}: " + "; ".join(
            f"{op}: {kernel}" for op, kernel in choices.items()))
    if options.get("tensor_parallel") and sch.world_size > 1:
        notes.append("Slapo TP: the input-gradient all-reduce of column-parallel linears runs "
                     "beside their weight gradients (sync overlap=, slapo.sharding.overlap)")
        vocab = padded_vocab_spec(sch.mod)
        if vocab is not None:
            words = vocab.full_shape[vocab.axis]
            notes.append(f"Slapo TP: the vocabulary of {words} words is sharded "
                         f"{vocab.local_size} a rank, padded to {words + vocab.padded} (shard "
                         "pad=True); the padded words are left out of the loss")
    return sch


def slapo_master_weights(system) -> bool:
    """Slapo's native systems train the whole model in bf16 with fp32 masters and no
    autocast (:mod:`.master_weights`), as Megatron-LM does, where the case is bf16 and
    - no data parallelism (DDP would reduce the gradients in bf16);
    - the scheduled model computes its loss itself, from the logits in float32 (the loss
      ``slapo.op.cross_entropy`` installs: every transformer family's schedule on CUDA).
      WideResNet's own loss would be computed in bf16, so it keeps autocast."""
    import torch

    from slapo import state

    return (system.autocast_dtype == torch.bfloat16 and system.dp_size == 1
            and state.loss_fn(system.model) is not None)


class SlapoTPSystem(TensorParallelTrainer):
    mode = "slapo-megatron"
    description = "HF model + Slapo schedule, tensor parallelism over all ranks (Slapo-TP)"
    shard_embedding = True
    uses_master_weights = slapo_master_weights

    def setup(self) -> None:
        self.model = scheduled_model(self.spec, self.ctx, self.notes, tensor_parallel=True,
                                     shard_embedding=self.shard_embedding, kernel_opt=True)
        self.make_optimizer()


class SlapoTPFullSystem(SlapoTPSystem):
    mode = "slapo-tp-full"
    description = "Figure 9 '+ Embedding TP': kernels + TP of attention, FFN and embedding"


class SlapoTPAttnFFNSystem(SlapoTPSystem):
    mode = "slapo-tp-attn-ffn"
    description = "Figure 9 '+ Attn/FFN TP': kernels + TP of attention and FFN"
    shard_embedding = False


class SlapoKernelSystem(NativeTrainer):
    mode = "slapo-kernel"
    description = "Figure 9 '+ Kernel Opt': fused kernels, no TP (data parallel if N > 1)"
    uses_master_weights = slapo_master_weights

    def setup(self) -> None:
        self.inner = scheduled_model(self.spec, self.ctx, self.notes, tensor_parallel=False,
                                     shard_embedding=False, kernel_opt=True)
        self.model = wrap_data_parallel(self.inner, self.ctx)
        self.make_optimizer()

    def params_on_rank(self) -> int:
        return sum(p.numel() for p in self.inner.parameters())
