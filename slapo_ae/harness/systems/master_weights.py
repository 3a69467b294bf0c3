"""The whole model in bf16, with fp32 master copies of its parameters that the optimizer steps:
how Megatron-LM (``--bf16``) and DeepSpeed's bf16 mode train, and the policy of Slapo-TP
(:func:`.slapo_tp.slapo_master_weights`) and of the ``megatron`` baseline with tensor
parallelism alone (:meth:`.megatron.MegatronSystem.uses_master_weights`) in bf16 on CUDA.

Under ``torch.autocast`` over fp32 parameters (the baselines' policy), each matrix product
casts its fp32 weight to bf16 at every call and its bf16 weight gradient back to fp32, and
the residual stream, norms and dropout between the products stay in fp32: in bert-large's
post-LayerNorm layers the hidden states are written in fp32 for the residual and again in
bf16 for the next product. In the 62ef84e H100 profile of bert-large, Slapo-TP's casting
kernels were 461 of its 2142 GPU commands a step, and its residual-stream kernels (LayerNorm
with the residual add and dropout, forward and backward) about 11 ms of its 92 ms of kernels
(``docs/gpu.md``).

:class:`MasterWeights` stores every floating parameter in bf16 instead, and the step runs
without autocast: the weights need no casts, and the activations, the residual stream, the
norms' outputs and their gradients move half the bytes. The optimizer steps fp32 masters; each
step copies the gradients up and the new values down in two multi-tensor copies
(``torch._foreach_copy_``, which casts between dtypes in its fast path on CUDA). The kernels
that need a wider accumulator keep it: LayerNorm and RMSNorm statistics, softmax in the
attention kernels and Inductor's generated code (which computes bf16 in fp32 registers), and
the matrix products' fp32 accumulation. The loss must be computed in float32 by the model:
the caller checks that (Slapo's losses upcast the logits, ``slapo.op.cross_entropy``, as
megatron-core's vocabulary-parallel cross entropy does).

This is not autocast's arithmetic: the residual stream is rounded to bf16 at each layer, and
a parameter used twice in a step (a weight tied to an embedding) adds its two gradients in
bf16. Slapo's losses are checked against hf-sdpa's (autocast over fp32) by the GPU check's
L target; ``tests/unit/test_master_weights.py`` states the tolerance on CPU. DDP, ZeRO-3 and
pipelines are left out: they would reduce or send bf16 where their systems use fp32.
"""
from __future__ import annotations

import torch


class MasterWeights:
    """Move every floating parameter of ``model`` to ``dtype`` in place (the Parameter objects
    stay, so shards, hooks and the schedule keep them), keeping fp32 masters: one for each
    parameter object, so a tied weight has one master. Buffers stay as they are (rotary
    frequencies in fp32, position ids).

    Give :attr:`optimizer_params` to the optimizer in place of ``model.parameters()``, call
    :meth:`step` in place of ``optimizer.step()``, and run the forward without autocast."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype):
        self.names, self.params, self.masters, others = [], [], [], []
        for name, param in model.named_parameters():
            if param.is_floating_point() and param.dtype != dtype:
                self.names.append(name)
                self.params.append(param)
                # an fp32 parameter's own storage becomes the master: it gives it up below
                self.masters.append(torch.nn.Parameter(param.detach().float(),
                                                       requires_grad=param.requires_grad))
                param.data = param.data.to(dtype)
            else:
                others.append(param)
        self.optimizer_params = self.masters + others
        self.dtype = dtype

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Copy the 16-bit gradients to the masters, step ``optimizer`` over them, copy the
        new values back to the 16-bit parameters."""
        pairs = [(param, master) for param, master in zip(self.params, self.masters)
                 if param.grad is not None]
        grads = [torch.empty_like(master) for _, master in pairs]
        if pairs:
            torch._foreach_copy_(grads, [param.grad for param, _ in pairs])
        for (param, master), grad in zip(pairs, grads):
            master.grad = grad
            param.grad = None
        optimizer.step()
        if self.params:
            torch._foreach_copy_(self.params, self.masters)

    def describe(self) -> str:
        """The precision policy in a line, for the record."""
        name = str(self.dtype).removeprefix("torch.")
        return (f"{name} parameters ({len(self.params)} tensors) with fp32 master copies that "
                "the optimizer steps (copied each way once a step, torch._foreach_copy_); no "
                f"autocast: activations, residual stream and norms in {name}, the loss in "
                "float32 (as Megatron-LM and DeepSpeed train in bf16)")
