"""sync: insert a collective, a resharding or a hook at a point of a module's forward or
backward."""

from __future__ import annotations

import inspect
from collections.abc import Callable

from .. import state
from ..hooks import map_first_input, on_first_tensor, outside_graphs, post_chain
from ..logger import get_logger
from ..sharding.overlap import defer_weight_grad, overlap_input, supports_overlap
from ..sharding.sync_ops import (
    apply_backward_op,
    apply_forward_op,
    describe_forward_ops,
    is_forward_op,
)
from . import register_primitive
from .decompose import inlined_reason
from .shard import shard_spec, take_local_ids

logger = get_logger(__name__)

SYNC_MODES = ("fwd_pre", "fwd_post", "bwd_post")
# upstream Slapo's hook form of a callable: the arguments torch passes to each kind of hook
HOOK_ARGUMENTS = {"fwd_pre": "(module, input)", "fwd_post": "(module, input, output)",
                  "bwd_post": "(module, grad_input, grad_output)"}


@register_primitive()
def sync(sch, mode: str = "bwd_post", sync_op_or_fn: str | Callable = "all_reduce",
         axis: int = 0, overlap: list[str] = (), tensor_parallel_output_grad: bool = True) -> None:
    """Synchronise across the schedule's group at one point of this module.

    ``mode``:
      - ``"fwd_pre"``: on the module's first tensor input, before its forward;
      - ``"fwd_post"``: on the module's (first) output, after its forward;
      - ``"bwd_post"``: on the gradient of the module's first tensor input, after its backward.

    ``sync_op_or_fn`` in the forward modes: ``"all_reduce"``, ``"all_gather"``,
    ``"reduce_scatter"`` or ``"scatter"`` (keep this rank's slice), the last three along
    ``axis`` (default 0, as upstream Slapo); a resharding of the last two axes such as
    ``"RS->SR"`` (``slapo.sharding.reshard``: R replicated, S sharded, axis -2 then -1); or
    a callable. Forward ops carry their adjoint into the backward (all-reduce: identity,
    reduce-scatter and scatter: all-gather); that is what a loss computed identically on every
    rank needs. An all-gather's backward depends on what reads the gathered tensor:
    ``tensor_parallel_output_grad=True`` (the default, as upstream) when a sharded computation
    does, such as a column-parallel linear after sequence parallelism, each rank holding a
    partial gradient (reduce-scatter); ``False`` when a replicated one does, such as full
    logits and the loss (keep this rank's slice). A backward sync takes ``"all_reduce"`` or
    a callable.

    A callable is either a tensor function (one argument: the tensor at that point, returns
    the new tensor; in ``bwd_post`` the gradient) or a hook in upstream Slapo's form, taking
    what torch passes to the hook of that mode: ``fn(module, input)`` (``input`` the tuple of
    positional arguments; returns new arguments or None), ``fn(module, input, output)``
    (returns a new output or None), ``fn(module, grad_input, grad_output)`` (a full backward
    hook: returns new input gradients or None).

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

    Example (an MLP between two layouts)::

        sch["fc1"].shard(["weight", "bias"], axis=0)     # output RS: my hidden features
        sch["fc1"].sync("fwd_post", "RS->SR")             # now my rows of the sequence
        sch["fc2"].sync("fwd_post", "SR->RR")             # the whole output on every rank
    """
    where = sch.path or "<root>"
    inlined = inlined_reason(sch)
    if inlined:  # a hook there would never run: the training would be silently wrong
        raise ValueError(f"sync at '{where}': {inlined}, so the sync would never run; sync "
                         "it before that trace, or keep it a call: trace(leaves=[...])")
    if mode not in SYNC_MODES:
        raise ValueError(f"unknown sync mode '{mode}' at '{where}'; expected one of {SYNC_MODES}")
    if callable(sync_op_or_fn):
        if mode == "fwd_pre" and take_local_ids(sch.mod):
            logger.info("sync at '%s': a fwd_pre function on a vocabulary-parallel embedding; "
                        "the ids it gives are taken as this rank's (upstream's schedules make "
                        "them local there), not masked again", where)
        state.note_sync(sch.mod, mode, "callable")
        if _is_hook(sync_op_or_fn, mode, where):
            _register_hook(sch.mod, mode, outside_graphs(sync_op_or_fn))
            return
    elif not is_forward_op(sync_op_or_fn):
        raise ValueError(f"unknown sync op '{sync_op_or_fn}' at '{where}'; expected one of "
                         f"{describe_forward_ops()}, or a callable")
    elif mode == "bwd_post" and sync_op_or_fn != "all_reduce":
        raise ValueError(f"sync op '{sync_op_or_fn}' at '{where}' changes the gradient's shape; "
                         "a bwd_post sync takes 'all_reduce' or a callable")
    if not tensor_parallel_output_grad and sync_op_or_fn != "all_gather":
        raise ValueError(f"sync at '{where}': tensor_parallel_output_grad applies to "
                         f"'all_gather' only, not to {sync_op_or_fn!r}")
    if overlap and (mode != "bwd_post" or sync_op_or_fn != "all_reduce"):
        raise ValueError(f"sync at '{where}': overlap applies to a bwd_post all_reduce only")
    linears = [_overlappable(sch, path) for path in overlap]
    group = sch.group
    state.note_sync(sch.mod, mode, sync_op_or_fn)  # for build's checks

    @outside_graphs
    def forward_op(x):
        return apply_forward_op(sync_op_or_fn, x, group, axis, tensor_parallel_output_grad)

    if mode == "fwd_post" and _reduces_before_bias(sch.mod):
        # its partial sums are reduced before its bias (and what it fuses with the bias:
        # an activation, a dropout), as upstream set the module's sync_fn
        if sch.mod.sync_fn is not None:
            raise ValueError(f"sync at '{where}': {type(sch.mod).__name__} already has a "
                             "sync_fn, which runs where this sync would")
        sch.mod.sync_fn = forward_op
        return
    if mode == "fwd_post":
        post_chain(sch.mod).append(on_first_tensor(forward_op))
        return
    # the other modes act on the first input: in the forward, or on its gradient
    if mode == "fwd_pre":
        fn = forward_op
    elif linears:
        for mod in linears:
            defer_weight_grad(mod)

        @outside_graphs
        def fn(x):
            return overlap_input(x, linears, group)
    else:
        @outside_graphs
        def fn(x):
            return apply_backward_op(sync_op_or_fn, x, group)
    sch.mod.register_forward_pre_hook(
        lambda mod, args, kwargs: map_first_input(args, kwargs, fn), with_kwargs=True)


def _is_hook(fn: Callable, mode: str, where: str) -> bool:
    """True for a hook in upstream's form, False for a tensor function (one argument)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False  # no signature to read (a builtin): taken as a tensor function
    positional = [p for p in params
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    if len(required) == 1:
        return False
    takes = HOOK_ARGUMENTS[mode].count(",") + 1
    varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
    if len(required) <= takes and (len(positional) >= takes or varargs):
        return True
    raise TypeError(f"sync at '{where}': a callable sync_op_or_fn takes one tensor, or the "
                    f"arguments of a {mode} hook {HOOK_ARGUMENTS[mode]}; "
                    f"{getattr(fn, '__qualname__', fn)!s}{inspect.signature(fn)} takes neither")


def _reduces_before_bias(mod) -> bool:
    """Whether ``mod`` is a row-parallel linear of a class whose forward reduces its partial
    sums before it adds its bias (``slapo.op.LinearWithSyncFunc`` and its subclasses)."""
    spec = shard_spec(getattr(mod, "weight", None))
    return (state.has_row_parallel_forward(mod) and getattr(mod, "bias", None) is not None
            and spec is not None and spec.axis == 1)


def _register_hook(mod, mode: str, hook: Callable) -> None:
    if mode == "fwd_pre":
        mod.register_forward_pre_hook(hook)
    elif mode == "fwd_post":
        post_chain(mod).append(hook)  # before a bias that sharding deferred, as a sync op
    else:
        mod.register_full_backward_hook(hook)


def _overlappable(sch, path: str):
    """The module at ``path`` below ``sch``, if it can overlap its weight gradient."""
    node = sch[path] if path else sch
    if not supports_overlap(node.mod):
        raise ValueError(f"sync at '{sch.path or '<root>'}': overlap lists '{node.path}', a "
                         f"{type(node.mod).__name__}; only an nn.Linear (or a subclass with an "
                         "epilogue, such as slapo.op.LinearGeLU or a decomposed Linear) can "
                         "overlap its weight gradient")
    return node.mod
