"""16-bit weights for the Linear layers, with fp32 master copies that the optimizer steps.

Under ``torch.autocast`` every Linear casts its fp32 weight and bias to the autocast dtype at
each call, and its weight gradient, computed in that dtype, is cast back to fp32 for the
parameter: two casts per tensor per step, each a kernel (Inductor fuses some of them). In the
62ef84e H100 profile of bert-large, Slapo-TP's casting kernels were 461 of its 2142 GPU
commands a step (25 of them the hidden states' casts between layers), and the GPU spent about
2.3 us outside kernels per command (``docs/gpu.md``). :class:`LinearMasterWeights` stores those
tensors in the autocast dtype instead, as Megatron-LM does, and keeps their fp32 values as
master copies: the optimizer steps the masters, and each step copies the gradients up and the
new values down in two multi-tensor copies (``torch._foreach_copy_``, which casts between
dtypes in its fast path on CUDA).

It is autocast's arithmetic: the Linear computes on the same 16-bit values (the rounding of
the same fp32 master), its gradient is the same 16-bit tensor, and the optimizer sees it in
fp32 as before; every other parameter (norms, embeddings, tied weights) stays fp32 under
autocast. That holds where each such tensor gets one gradient a step, as in every model of
the zoo. Where a forward runs a layer more than once (ALBERT's shared layer), its gradients
add up in bf16 before they reach the master; autocast over fp32 parameters adds them in fp32
when the layer is compiled (each call casts the weight itself), and in bf16 when it runs
eagerly (autocast's cast cache gives all the calls one bf16 copy).
"""
from __future__ import annotations

import torch


class LinearMasterWeights:
    """Move the parameters of ``model``'s ``nn.Linear`` modules to ``dtype`` in place (the
    Parameter objects stay, so shards, hooks and the schedule keep them), keeping fp32 masters.
    A parameter that another module holds too (a weight tied to an embedding) stays as it is.

    Give :attr:`optimizer_params` to the optimizer in place of ``model.parameters()`` and call
    :meth:`step` in place of ``optimizer.step()``."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype):
        holders = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            holders.setdefault(id(param), []).append(name)
        linear = {id(p) for mod in model.modules() if isinstance(mod, torch.nn.Linear)
                  for p in mod.parameters(recurse=False)}
        self.names, self.params, self.masters, others = [], [], [], []
        for name, param in model.named_parameters():
            if id(param) in linear and len(holders[id(param)]) == 1 and param.dtype != dtype:
                self.names.append(name)
                self.params.append(param)
                self.masters.append(torch.nn.Parameter(param.detach().clone()))
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
        return (f"{len(self.params)} Linear weight and bias tensors stored in {self.dtype} with "
                "fp32 master copies that the optimizer steps (copied each way once a step, "
                "torch._foreach_copy_)")
