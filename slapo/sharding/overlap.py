"""The input-gradient all-reduce of column-parallel linears, overlapped with their weight
gradients (Megatron-LM's asynchronous all-reduce).

Column-parallel projections (Q, K and V; the FFN's first linear) read the same replicated
input, so the gradient of that input is the sum of their contributions, all-reduced over the
tensor-parallel group. Plain autograd computes each linear's input and weight gradient
together and only then the all-reduce, which every rank waits for. Here each linear's
backward computes its input gradient only and leaves ``grad_output`` and its input with the
module's *pending* weight gradients; once every contribution is summed, one node starts the
all-reduce asynchronously, computes the pending weight gradients while it runs, waits, and
hands the parameters their gradients through autograd (so accumulation and parameter hooks
work as usual).

The node sits on the module's first input (``sync("bwd_post", "all_reduce", overlap=...)``):
its forward is the identity on the input and on the linears' parameters, and it marks the
input tensor it returns; a listed linear called on a marked tensor uses the node's views of
its parameters and defers its weight gradient; called on anything else (a tensor the module's
forward made from the input, another input), it computes as usual. Either way the result is
the plain module's, which the TP tests check against the unsharded model.

A linear takes part if it is an ``nn.Linear`` or a subclass whose forward is
``self.epilogue(F.linear(x, self.weight))`` and that says so with an ``epilogue`` method (the
bias then stays with the epilogue, e.g. ``slapo.op.LinearGeLU``'s fused bias+GeLU, or a
``decompose``d linear, whose bias the traced graph adds after it), or one that computes
``F.linear(x, self.weight, self.bias)`` on weight rows padded with zeros and says how many with
a ``padding(x)`` method (``slapo.op.PaddedLinear``): the deferred products pad the same way.

Under ``torch.autocast`` the deferred product computes in the autocast dtype, as ``F.linear``
would: its input, weight and bias are cast before it (casts autograd differentiates, so the
gradients reach the fp32 parameters in fp32) and the product itself runs with autocast off.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .. import state
from ..hooks import outside_graphs
from .collectives import world_size


def supports_overlap(mod: nn.Module) -> bool:
    """Whether ``mod`` can defer its weight gradient (see the module docstring)."""
    return _adds_own_bias(mod) or (isinstance(mod, nn.Linear) and hasattr(mod, "epilogue"))


def _adds_own_bias(mod: nn.Module) -> bool:
    """A linear whose product adds its bias: an ``nn.Linear``, or one that pads its rows."""
    return type(mod) is nn.Linear or (isinstance(mod, nn.Linear) and hasattr(mod, "padding"))


class PendingWeightGrads:
    """One forward call of the synchronised module, as its backward needs it: where each
    linear's parameters sit among those the node passes through and, filled in the backward,
    the (grad_output, input) pairs their weight gradients need.

    It must not hold the node's outputs (the views of the parameters): the node's context
    holds it, and outputs -> node -> context -> outputs is a cycle through autograd's C++
    graph that Python's garbage collector does not free, so every step would keep its
    views and graph alive (12 MB a step on t5-tiny, 2026-12-02). The views travel with the
    marked input instead (:class:`MarkedInput`).
    """

    def __init__(self, linears: list[nn.Module]):
        self.linears = linears
        # per linear: the slots of its weight and of its bias (or None) among params()
        self.slots: list[tuple[int, int | None]] = []
        at = 0
        for mod in linears:
            bias = at + 1 if _bias_is_deferred(mod) else None
            self.slots.append((at, bias))
            at += 1 if bias is None else 2
        self.pairs: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (linear index, g, x)

    def params(self) -> list[torch.Tensor]:
        """The parameters the node passes through: each linear's weight, then its bias if
        the deferred matmul adds it (plain ``nn.Linear`` with a bias)."""
        out = []
        for mod, (_, bias) in zip(self.linears, self.slots):
            out += [mod.weight] if bias is None else [mod.weight, mod.bias]
        return out


def _bias_is_deferred(mod: nn.Module) -> bool:
    return _adds_own_bias(mod) and mod.bias is not None


class _Overlap(torch.autograd.Function):
    """Identity on ``x`` and on the parameters; the backward all-reduces the gradient of
    ``x`` while computing the pending weight gradients."""

    @staticmethod
    def forward(ctx, x, pending: PendingWeightGrads, group, *params):
        ctx.pending, ctx.group = pending, group
        ctx.set_materialize_grads(False)
        return (x.view_as(x), *(p.view_as(p) for p in params))

    @staticmethod
    def backward(ctx, grad_x, *grad_params):
        pending = ctx.pending
        work = None
        if grad_x is not None and world_size(ctx.group) > 1:
            grad_x = grad_x.contiguous().clone()
            work = dist.all_reduce(grad_x, group=ctx.group, async_op=True)
        grads = _weight_grads(pending, list(grad_params))
        if work is not None:
            work.wait()
        pending.pairs.clear()
        return (grad_x, None, None, *grads)


def _weight_grads(pending: PendingWeightGrads, grads: list) -> list:
    """Add each pending (grad_output, input) pair's weight (and deferred bias) gradient to
    ``grads``, laid out as :meth:`PendingWeightGrads.params`."""
    for index, g, x in pending.pairs:
        weight, bias = pending.slots[index]
        param = pending.linears[index].weight
        rows = param.shape[0]  # g may hold zero columns past them (a padded product)
        g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        grads[weight] = _add(grads[weight], g2.t().mm(x2)[:rows].to(param.dtype))
        if bias is not None:
            grads[bias] = _add(grads[bias], g2.sum(0)[:rows].to(param.dtype))
    return grads


def _add(total, part):
    return part if total is None else total + part


class _DeferredLinear(torch.autograd.Function):
    """``x @ W^T (+ b)`` whose backward returns the input gradient only and leaves the weight
    gradient pending (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, pending: PendingWeightGrads, index: int, pad: int):
        if pad:  # zero rows, so that the products run on aligned shapes (PaddedLinear)
            weight = F.pad(weight, (0, 0, 0, pad))
            bias = None if bias is None else F.pad(bias, (0, pad))
        ctx.save_for_backward(x, weight)
        ctx.pending, ctx.index, ctx.pad = pending, index, pad
        y = F.linear(x, weight, bias)
        return y[..., :y.shape[-1] - pad] if pad else y

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        if ctx.pad:
            grad = F.pad(grad, (0, ctx.pad))
        ctx.pending.pairs.append((ctx.index, grad, x))
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        return grad_x, None, None, None, None, None


def _autocast_cast(x, weight, bias):
    """The deferred product's operands in the dtype ``F.linear`` would compute in under the
    autocast active for ``x``'s device (unchanged without one)."""
    device = x.device.type
    if not torch.amp.is_autocast_available(device) or not torch.is_autocast_enabled(device):
        return x, weight, bias
    dtype = torch.get_autocast_dtype(device)
    return tuple(None if t is None else t.to(dtype) for t in (x, weight, bias))


def _autocast_off(device: str):
    # a device without autocast (the meta device: a model made under init_empty_weights,
    # traced) has none to turn off
    if torch.amp.is_autocast_available(device):
        return torch.autocast(device, enabled=False)
    return contextlib.nullcontext()


class MarkedInput:
    """The mark :func:`overlap_input` puts on the input it returns, read by the listed
    linears' forwards: the call's pending weight gradients and, by module, the linear's
    index and the node's views of its weight and deferred bias."""

    def __init__(self, pending: PendingWeightGrads,
                 views: dict[int, tuple[int, torch.Tensor, torch.Tensor | None]]):
        self.pending, self.views = pending, views


def overlap_input(x: torch.Tensor, linears: list[nn.Module], group) -> torch.Tensor:
    """The module input ``x`` through the overlap node, marked for ``linears``."""
    pending = PendingWeightGrads(linears)
    out, *views = _Overlap.apply(x, pending, group, *pending.params())
    by_module = {id(mod): (index, views[weight], None if bias is None else views[bias])
                 for index, (mod, (weight, bias)) in enumerate(zip(linears, pending.slots))}
    state.set_pending_weight_grads(out, MarkedInput(pending, by_module))
    return out


def defer_weight_grad(mod: nn.Module) -> None:
    """Let ``mod`` (see :func:`supports_overlap`) defer its weight gradient when called on an
    input marked by :func:`overlap_input` for it."""
    if state.defers_weight_grad(mod):
        return
    plain = mod.forward

    @outside_graphs  # the mark is found by the input's identity, which a graph cannot guard
    def forward(x, *args, **kwargs):
        mark = state.pending_weight_grads(x)
        views = mark.views.get(id(mod)) if mark is not None else None
        if views is None or args or kwargs:
            return plain(x, *args, **kwargs)
        index, weight, bias = views
        pad = mod.padding(x) if hasattr(mod, "padding") else 0
        x, weight, bias = _autocast_cast(x, weight, bias)
        with _autocast_off(x.device.type):
            y = _DeferredLinear.apply(x, weight, bias, mark.pending, index, pad)
        return y if _adds_own_bias(mod) else mod.epilogue(y)

    mod.forward = forward
    state.mark_defers_weight_grad(mod)
