"""sync: insert a collective at a point of a module's forward or backward."""

from __future__ import annotations

from collections.abc import Callable

from ..hooks import map_first_input, post_chain
from ..sharding.collectives import FORWARD_OPS, apply_backward_op, apply_forward_op
from ..sharding.overlap import defer_weight_grad, overlap_input, supports_overlap
from . import register_primitive

SYNC_MODES = ("fwd_pre", "fwd_post", "bwd_post")


@register_primitive()
def sync(sch, mode: str = "bwd_post", sync_op_or_fn: str | Callable = "all_reduce",
         axis: int | None = None, overlap: list[str] = ()) -> None:
    """Synchronise across the schedule's group at one point of this module.

    ``mode``:
      - ``"fwd_pre"``: on the module's first tensor input, before its forward;
      - ``"fwd_post"``: on the module's (first) output, after its forward;
      - ``"bwd_post"``: on the gradient of the module's first tensor input, after its backward.

    ``sync_op_or_fn``: ``"all_reduce"``, ``"all_gather"`` or ``"reduce_scatter"`` (forward
    modes; the last two along ``axis``, default -1 and 0), or a callable ``tensor -> tensor``.
    Forward collectives carry their adjoint into the backward (all-reduce: identity,
    all-gather: this rank's slice, reduce-scatter: all-gather), which is what a loss computed
    identically on every rank needs. A backward sync takes ``"all_reduce"`` or a callable.

    ``overlap`` (a ``bwd_post`` all-reduce only): the column-parallel linears below this module
    (paths relative to it, ``""`` for the module itself) that read its first input. Their
    weight gradients are computed while the input gradient's all-reduce runs instead of before
    it (Megatron-LM's asynchronous all-reduce, ``slapo.sharding.overlap``); the gradients are
    the same. A listed linear called on another tensor computes as usual.

    Example (Megatron-style attention)::

        attn = sch["encoder.layer.0.attention"]
        attn["self"].sync("bwd_post", "all_reduce",                # input grad of column-
                          overlap=["query", "key", "value"])      # parallel Q, K, V
        attn["output.dense"].sync("fwd_post", "all_reduce")  # partial sums of row-parallel out
    """
    where = sch.path or "<root>"
    if mode not in SYNC_MODES:
        raise ValueError(f"unknown sync mode '{mode}' at '{where}'; expected one of {SYNC_MODES}")
    if not callable(sync_op_or_fn) and sync_op_or_fn not in FORWARD_OPS:
        raise ValueError(f"unknown sync op '{sync_op_or_fn}' at '{where}'; expected one of "
                         f"{FORWARD_OPS} or a callable")
    if mode == "bwd_post" and not callable(sync_op_or_fn) and sync_op_or_fn != "all_reduce":
        raise ValueError(f"sync op '{sync_op_or_fn}' at '{where}' changes the gradient's shape; "
                         "a bwd_post sync takes 'all_reduce' or a callable")
    if overlap and (mode != "bwd_post" or sync_op_or_fn != "all_reduce"):
        raise ValueError(f"sync at '{where}': overlap applies to a bwd_post all_reduce only")
    linears = [_overlappable(sch, path) for path in overlap]
    group = sch.group
    if mode == "fwd_post":
        post_chain(sch.mod).append(lambda x: apply_forward_op(sync_op_or_fn, x, group, axis))
        return
    # the other modes act on the first input: in the forward, or on its gradient
    if mode == "fwd_pre":
        def fn(x):
            return apply_forward_op(sync_op_or_fn, x, group, axis)
    elif linears:
        for mod in linears:
            defer_weight_grad(mod)

        def fn(x):
            return overlap_input(x, linears, group)
    else:
        def fn(x):
            return apply_backward_op(sync_op_or_fn, x, group)
    sch.mod.register_forward_pre_hook(
        lambda mod, args, kwargs: map_first_input(args, kwargs, fn), with_kwargs=True)


def _overlappable(sch, path: str):
    """The module at ``path`` below ``sch``, if it can overlap its weight gradient."""
    node = sch[path] if path else sch
    if not supports_overlap(node.mod):
        raise ValueError(f"sync at '{sch.path or '<root>'}': overlap lists '{node.path}', a "
                         f"{type(node.mod).__name__}; only an nn.Linear (or a subclass with an "
                         "epilogue, such as slapo.op.LinearGeLU or a decomposed Linear) can "
                         "overlap its weight gradient")
    return node.mod
