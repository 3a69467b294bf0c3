"""The interface every system (mode) of the harness implements, and shared training pieces.

A system turns a :class:`~slapo_ae.harness.runspec.RunSpec` into a model and an optimizer on this
rank and trains it one step at a time:

    support.check(spec)                  # cheap, no torch: raises Unsupported (.support;
                                         # the parent calls it before launching, too)
    system = SYSTEM_CLASS(spec, ctx)     # ctx: this rank's place (DistContext)
    system.setup()                       # build model + optimizer (may raise Unsupported)
    loss = system.train_step(batch)      # batch: this rank's slice of the global batch
    system.params_on_rank()

``dp_size``/``dp_rank`` say how the global batch is split: data-parallel systems (eager,
ZeRO-3) give each rank ``batch / dp_size`` samples; tensor-parallel ones (Megatron, Slapo-TP)
have ``dp_size == 1`` and every rank sees the whole batch. ``train_step`` returns this rank's
loss (a detached 0-dim tensor; the harness averages it over ranks after timing).

Precision: fp32 everywhere on CPU (16-bit is refused as unsupported there). On CUDA the
torch-native loops (:class:`NativeTrainer`) keep fp32 parameters (the master weights) and run
the step under ``torch.autocast`` in fp16 (with a ``GradScaler``) or bf16, except where bf16
trains the whole model in bf16 (below); DeepSpeed systems use DeepSpeed's own fp16/bf16
settings, which also keep fp32 master weights. Every system's record states its policy
(``precision``) and its optimizer (``optimizer``).

Optimizer: ``torch.optim.AdamW`` for every system (:func:`adamw`), with its fused kernel on
CUDA (one kernel over all parameters: the default foreach implementation was 13% of a step's
GPU time on one H200) and torch's default on CPU (a for-loop there). The same for the
baselines as for Slapo: the comparison is about the schedule, not the optimizer.

Slapo's native systems (``slapo_tp.py``) and the ``megatron`` baseline with tensor
parallelism alone (``megatron.py``) train in bf16 on CUDA as Megatron-LM and DeepSpeed do: the
whole model in bf16 with fp32 master copies that the optimizer steps, no autocast, the loss in
float32 (:mod:`.master_weights`). The weights need no casts a step, and the residual stream,
norms and activations move half the bytes (in the 62ef84e H100 profile of bert-large under
autocast, Slapo-TP's casting kernels were 461 of its 2142 GPU commands a step and its
residual-stream kernels about 11 ms of 92). The HF baselines keep autocast over fp32
parameters: what a user of HF and torch.compile picks. Not yet measured on a GPU.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
import torch.distributed as dist

from .support import Unsupported


@dataclasses.dataclass
class DistContext:
    """This rank's place: global rank and size, local rank, the device it computes on."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device


TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def adamw(params, lr: float, device: torch.device) -> torch.optim.AdamW:
    """The optimizer of every system: AdamW, fused on CUDA (see the module docstring)."""
    return torch.optim.AdamW(params, lr=lr, fused=device.type == "cuda")


def optimizer_name(optimizer: torch.optim.Optimizer) -> str:
    """What the record says of an optimizer: its class and implementation (torch's default,
    ``foreach=None``, is foreach when the parameters are on CUDA, a for-loop elsewhere)."""
    defaults = optimizer.defaults
    foreach = defaults.get("foreach")
    if foreach is None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        foreach = bool(params) and all(p.device.type == "cuda" for p in params)
    kind = "fused" if defaults.get("fused") else "foreach" if foreach else "for-loop"
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__} ({kind})"


class System:
    """Base class of the systems; see the module docstring for the protocol."""

    mode: ClassVar[str] = ""
    description: ClassVar[str] = ""

    def __init__(self, spec, ctx: DistContext):
        self.spec = spec
        self.ctx = ctx
        self.notes: list[str] = []  # facts a reader of the record should know
        self.model = None

    # -- how the global batch is split --------------------------------------------------
    @property
    def dp_size(self) -> int:
        return self.ctx.world_size

    @property
    def dp_rank(self) -> int:
        return self.ctx.rank

    @property
    def tp_size(self) -> int:
        return 1

    def micro_batch(self) -> int:
        if self.spec.case.batch_size % self.dp_size:
            raise Unsupported(f"global batch {self.spec.case.batch_size} is not divisible by "
                              f"{self.dp_size} data-parallel ranks")
        return self.spec.case.batch_size // self.dp_size

    # -- the work -----------------------------------------------------------------------
    def setup(self) -> None:
        raise NotImplementedError

    def train_step(self, batch: dict) -> torch.Tensor:
        raise NotImplementedError

    def params_on_rank(self) -> int:
        """Parameter elements this rank holds (its shards under TP or ZeRO-3)."""
        return sum(p.numel() for p in self.model.parameters())

    def info(self) -> dict:
        return {"dp_size": self.dp_size, "tp_size": self.tp_size,
                "micro_batch": self.spec.case.batch_size // self.dp_size,
                "precision": self.precision(), "optimizer": self.optimizer_info()}

    def precision(self) -> str:
        """The precision policy, for the record."""
        return "fp32"

    def optimizer_info(self) -> str | None:
        optimizer = getattr(self, "optimizer", None)
        return optimizer_name(optimizer) if optimizer is not None else None


class NativeTrainer(System):
    """A torch-native training step: AdamW over fp32 parameters, autocast on CUDA in 16-bit,
    a GradScaler for fp16; or the whole model in bf16 with fp32 masters and no autocast, where
    :meth:`uses_master_weights`. Subclasses set ``self.model`` in ``setup`` (then call
    :meth:`make_optimizer`) and implement :meth:`forward_loss`."""

    master_weights = None  # a MasterWeights where uses_master_weights()

    def make_optimizer(self, params=None) -> None:
        self.set_precision()
        self.master_weights = None
        if params is None and self.uses_master_weights():
            from .master_weights import MasterWeights

            self.master_weights = MasterWeights(self.model, self.autocast_dtype)
            params = self.master_weights.optimizer_params
        params = list(self.model.parameters() if params is None else params)
        self.optimizer = adamw(params, self.spec.case.lr, self.ctx.device)

    def uses_master_weights(self) -> bool:
        """Whether the model trains in 16 bit with fp32 masters and no autocast
        (:mod:`.master_weights`); the systems that do override this."""
        return False

    def set_precision(self) -> None:
        """Autocast in the case's 16-bit dtype on CUDA, with a GradScaler for fp16; fp32
        elsewhere."""
        self.autocast_dtype = None
        self.scaler = None
        if self.ctx.device.type == "cuda" and self.spec.case.dtype != "fp32":
            self.autocast_dtype = TORCH_DTYPES[self.spec.case.dtype]
            if self.spec.case.dtype == "fp16":
                self.scaler = torch.amp.GradScaler("cuda")

    def forward_loss(self, batch: dict) -> torch.Tensor:
        return self.model(**batch).loss

    def precision(self) -> str:
        if self.autocast_dtype is None:
            return "fp32"
        if self.master_weights is not None:
            return self.master_weights.describe()
        return (f"{self.spec.case.dtype} autocast over fp32 parameters (the master weights)"
                + (", dynamic loss scaling" if self.scaler is not None else ""))

    def model_parallel_group(self):
        """Group whose ranks hold shards of one model (fp16: they must agree on skipping a
        step when any shard's gradients overflow). None when parameters are not sharded."""
        if self.tp_size > 1 and dist.is_initialized():
            return dist.group.WORLD
        return None

    def train_step(self, batch: dict) -> torch.Tensor:
        if self.autocast_dtype is not None and self.master_weights is None:
            with torch.autocast(device_type=self.ctx.device.type, dtype=self.autocast_dtype):
                loss = self.forward_loss(batch)
        else:
            loss = self.forward_loss(batch)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.optimizer)
            group = self.model_parallel_group()
            if group is not None:
                # found_inf is per rank; a shard that overflowed must skip the step everywhere
                for found in self.scaler._found_inf_per_device(self.optimizer).values():
                    dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            loss.backward()
            if self.master_weights is not None:
                self.master_weights.step(self.optimizer)
            else:
                self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach().float()


class TensorParallelTrainer(NativeTrainer):
    """A native trainer with tensor parallelism over all ranks: no data parallelism, so
    every rank sees the whole global batch."""

    @property
    def dp_size(self) -> int:
        return 1

    @property
    def dp_rank(self) -> int:
        return 0

    @property
    def tp_size(self) -> int:
        return self.ctx.world_size


def hf_overrides(spec) -> dict:
    """Model config overrides of a run: dropout off with ``--no-dropout``, then ``--override``."""
    from slapo_ae.zoo import no_dropout

    overrides = dict(no_dropout(spec.case.model)) if spec.case.no_dropout else {}
    overrides.update(spec.case.overrides)
    return overrides


def build_hf_model(spec, device, attn_implementation: str = "eager") -> torch.nn.Module:
    """The zoo model of ``spec`` with the run's seed and fp32 parameters; HF eager attention
    by default (the model "as is", as the paper's baselines ran it)."""
    from slapo_ae.zoo import build_model

    return build_model(spec.case.model, device=device, dtype=torch.float32, seed=spec.case.seed,
                       attn_implementation=attn_implementation, **hf_overrides(spec))


def checkpoint_every_layer(model, notes: list[str]) -> None:
    """Activation checkpointing of every layer, the way the baselines do it: HF's
    ``gradient_checkpointing_enable`` (non-reentrant); a model without it (the project's
    WideResNet) gets each residual block wrapped in ``torch.utils.checkpoint``."""
    import functools

    from torch.utils.checkpoint import checkpoint

    if getattr(model, "supports_gradient_checkpointing", False):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        notes.append("HF gradient checkpointing on (every layer) for ckpt > 0")
        return
    from slapo_ae.zoo.wideresnet import Bottleneck

    blocks = [m for m in model.modules() if isinstance(m, Bottleneck)]
    if not blocks:
        raise Unsupported(f"{type(model).__name__} has no gradient checkpointing")
    for block in blocks:
        inner = block.forward

        @functools.wraps(inner)
        def forward(x, _inner=inner):
            if not torch.is_grad_enabled():
                return _inner(x)
            return checkpoint(_inner, x, use_reentrant=False)

        block.forward = forward
    notes.append(f"torch.utils.checkpoint on every residual block ({len(blocks)}) for ckpt > 0")
