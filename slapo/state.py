"""Every ``_slapo_*`` attribute: the marks slapo sets on modules and other objects.

Primitives change modules in place, and some of them leave a mark that a later primitive,
the tracer or a hook reads back. Each mark is a named attribute, declared here with who
writes it and who reads it; everything in slapo goes through the functions below.

They stay separate attributes, not one state object per module, because they live in
different places and are read differently: marks of a module *class* hold for every instance
and copy; instance marks are plain entries of the module's ``__dict__``, so ``copy.deepcopy``
copies them, a GraphModule that keeps the module as a submodule keeps them (it holds the same
object), and a module put in its place by ``replace`` starts without them. Tests and user
code may read ``_slapo_checkpointed`` directly.

Not a mark: the annotations of ``annotate`` are data the user asked for, public as upstream
Slapo had them (``param.slapo_annotations`` and ``param.<key>``), kept by
``slapo/primitives/_params.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# --- marks of module classes ------------------------------------------------------------
# Written by the class definitions of FusedModule (fuse) and DecomposedLinear (decompose);
# read by the tracer (SlapoTracer.is_leaf_module) and by pipeline splitting (_reach, which
# refuses to cut inside a leaf).
LEAF = "_slapo_leaf"  # True: the tracer keeps the module as one call, never traces into it
# Written by DecomposedLinear (decompose); read by the tracer (SlapoTracer._attr_alias).
ATTR_ALIAS = "_slapo_attr_alias"  # {registered parameter name: attribute the graph reads}

# Written by the class definition of slapo.op.LinearWithSyncFunc; read by shard, which then
# keeps the class's own forward for a row-parallel shard (it reduces before its bias).
ROW_PARALLEL_FORWARD = "_slapo_row_parallel_forward"  # True: the forward syncs, then adds bias

# --- marks of module instances ------------------------------------------------------------
# Written and read by checkpoint (applying it twice is a no-op).
CHECKPOINTED = "_slapo_checkpointed"  # True: the forward is wrapped in torch checkpointing
# Written and read by compile (applying it twice is a no-op).
COMPILED = "_slapo_compiled"  # True: the forward is wrapped in torch.compile
# Written by hooks.post_chain (sync "fwd_post", shard's deferred bias); read by the forward
# hook that post_chain registers with it.
POST_CHAIN = "_slapo_post_chain"  # output hooks run, in order, after the forward
# Written by sync; read by build, which refuses a reducing sync (all_reduce,
# reduce_scatter) on ranks where nothing is sharded (each would sum whole copies), and warns
# of a Linear made column parallel through a tie with no sync on its input's gradient.
SYNCS = "_slapo_syncs"  # [(mode, op or "callable"), ...] registered on the module
# Written by shard, on a Linear whose weight another module's shard sharded along axis 0
# (a tie: an LM head sharing the word embedding); read by build (above).
TIED_COLUMN_PARALLEL = "_slapo_tied_column_parallel"  # the path of the shard that did it

# Written by hooks.defer_bias (shard of a row-parallel Linear/Conv); read by the same hook.
DEFERRED_BIAS = "_slapo_deferred_bias"  # True: the hook adds ``bias`` after the chain

# Written by sharding.overlap.defer_weight_grad (sync "bwd_post" with ``overlap``); read by
# the same function, so that a linear listed twice is patched once.
DEFERS_WEIGHT_GRAD = "_slapo_defers_weight_grad"  # True: the forward may defer its weight grad

# Written by shard (vocabulary-parallel nn.Embedding); read by build.initialize, which gives
# the module its full padding row back while it initialises the full-size weight.
FULL_PADDING_IDX = "_slapo_full_padding_idx"  # the padding_idx before sharding

# Written by pipeline.generate_pipeline_partition on the module it puts at the schedule
# root; read by pipeline.split_stages, which then takes its children as the stages.
PIPELINE_PARTITION = "_slapo_pipeline_partition"  # True: the children submod_<k> are stages

# Written by op.vocab_parallel_loss on the model whose forward it wraps; read by trace, which
# traces a root model's own forward without the wrapper and hands the loss to the pipeline.
LOSS_FN = "_slapo_loss_fn"  # loss_fn(output, target): the wrapper's loss from the output

# Written by model_schedule.common.mark_shared_layers (a schedule of a model that calls one
# module several times a forward: ALBERT's shared layers); read by engines.zero3_leaf_refusal.
CALLS_PER_FORWARD = "_slapo_calls_per_forward"  # how many times a forward runs the module

# --- marks of tensors ----------------------------------------------------------------------
# Written by sharding.overlap.overlap_input on the module input it returns; read by the
# forward of the linears it lists (defer_weight_grad).
PENDING_WEIGHT_GRADS = "_slapo_pending_weight_grads"  # the call's overlap.MarkedInput

# --- marks of the root Schedule -----------------------------------------------------------
# Written by cut_pipeline_stage (pipeline.record_cut); read by pipeline.split_stages.
PIPELINE_CUTS = "_slapo_pipeline_cuts"  # the module paths a stage ends after, in cut order
# Written by trace of a root whose forward computed a vocab-parallel loss (LOSS_FN); read by
# pipeline.build_pipeline, whose last stage computes that loss when no loss_fn is given.
PIPELINE_LOSS = "_slapo_pipeline_loss"

# Written by the tracer on a submodule it kept whole because it could not trace it (the
# error, as text); read by the errors of primitives that then find no graph calling a module
# inside it.
UNTRACED = "_slapo_untraced"

# --- tracer-private marks -----------------------------------------------------------------
# Written on the wrappers the tracer puts in place of torch constructors (torch.arange, ...)
# and read when patching, so that a nested trace does not wrap a wrapper.
CONSTRUCTOR_WRAPPER = "_slapo_constructor"
# Written on an exception by the tracer where a module call fails; read when the error is
# turned into a TraceError, which then names that innermost module.
ERROR_WHERE = "_slapo_where"  # (schedule path, class name) of the failing module


# Class marks: set by decorators on the class, read on instances.
def leaf_class(cls: type) -> type:
    """Class decorator: the tracer keeps instances of ``cls`` as leaves."""
    setattr(cls, LEAF, True)
    return cls


def is_leaf(mod: Any) -> bool:
    return getattr(mod, LEAF, False)


def attr_aliases(**aliases: str) -> Callable[[type], type]:
    """Class decorator: the graph reads the parameter registered as ``name`` through the
    attribute ``aliases[name]`` (the class exposes the parameter only under that name)."""
    def mark(cls: type) -> type:
        setattr(cls, ATTR_ALIAS, dict(aliases))
        return cls
    return mark


def attr_alias(mod: Any, name: str) -> str | None:
    """The attribute through which a graph reads ``mod``'s parameter ``name``, if another."""
    return getattr(mod, ATTR_ALIAS, {}).get(name)


def row_parallel_forward_class(cls: type) -> type:
    """Class decorator: the forward of ``cls`` reduces its partial sums before it adds the
    bias, so a row-parallel shard keeps it."""
    setattr(cls, ROW_PARALLEL_FORWARD, True)
    return cls


def has_row_parallel_forward(mod: Any) -> bool:
    return getattr(type(mod), ROW_PARALLEL_FORWARD, False)


# Instance marks.
def is_checkpointed(mod: Any) -> bool:
    return getattr(mod, CHECKPOINTED, False)


def mark_checkpointed(mod: Any) -> None:
    setattr(mod, CHECKPOINTED, True)


def calls_per_forward(mod: Any) -> int:
    return int(mod.__dict__.get(CALLS_PER_FORWARD, 1))


def set_calls_per_forward(mod: Any, calls: int) -> None:
    setattr(mod, CALLS_PER_FORWARD, calls)


# Read from the instance's __dict__ only: nn.Module.__getattr__ would also look for a
# submodule or parameter of that name, and a class attribute must not count.
def is_compiled(mod: Any) -> bool:
    return bool(mod.__dict__.get(COMPILED, False))


def mark_compiled(mod: Any) -> None:
    mod.__dict__[COMPILED] = True


def note_sync(mod: Any, mode: str, op: str) -> None:
    mod.__dict__.setdefault(SYNCS, []).append((mode, op))


def syncs(mod: Any) -> list:
    return mod.__dict__.get(SYNCS, [])


def mark_tied_column_parallel(mod: Any, shard_path: str) -> None:
    mod.__dict__[TIED_COLUMN_PARALLEL] = shard_path


def tied_column_parallel(mod: Any) -> str | None:
    return mod.__dict__.get(TIED_COLUMN_PARALLEL)


def post_chain_of(mod: Any) -> list | None:
    return mod.__dict__.get(POST_CHAIN)


def set_post_chain(mod: Any, chain: list) -> None:
    mod.__dict__[POST_CHAIN] = chain


def has_deferred_bias(mod: Any) -> bool:
    return bool(mod.__dict__.get(DEFERRED_BIAS))


def mark_deferred_bias(mod: Any) -> None:
    mod.__dict__[DEFERRED_BIAS] = True


def defers_weight_grad(mod: Any) -> bool:
    return bool(mod.__dict__.get(DEFERS_WEIGHT_GRAD))


def mark_defers_weight_grad(mod: Any) -> None:
    mod.__dict__[DEFERS_WEIGHT_GRAD] = True


def full_padding_idx(mod: Any) -> int | None:
    return mod.__dict__.get(FULL_PADDING_IDX)


def set_full_padding_idx(mod: Any, padding_idx: int) -> None:
    mod.__dict__[FULL_PADDING_IDX] = padding_idx


def untraced_reason(mod: Any) -> str | None:
    return mod.__dict__.get(UNTRACED)


def set_untraced_reason(mod: Any, reason: str | None) -> None:
    if reason is None:
        mod.__dict__.pop(UNTRACED, None)
    else:
        mod.__dict__[UNTRACED] = reason


def is_pipeline_partition(mod: Any) -> bool:
    return bool(mod.__dict__.get(PIPELINE_PARTITION))


def mark_pipeline_partition(mod: Any) -> None:
    mod.__dict__[PIPELINE_PARTITION] = True


def loss_fn(mod: Any) -> Callable | None:
    return mod.__dict__.get(LOSS_FN)


def set_loss_fn(mod: Any, fn: Callable) -> None:
    mod.__dict__[LOSS_FN] = fn


# Tensor marks: a plain attribute of the tensor object (views and copies start without it).
def pending_weight_grads(tensor: Any) -> Any:
    return getattr(tensor, PENDING_WEIGHT_GRADS, None)


def set_pending_weight_grads(tensor: Any, pending: Any) -> None:
    setattr(tensor, PENDING_WEIGHT_GRADS, pending)


# Root Schedule marks.
def add_pipeline_cut(root: Any, path: str) -> None:
    cuts = root.__dict__.setdefault(PIPELINE_CUTS, [])
    if path not in cuts:
        cuts.append(path)


def pipeline_cuts(root: Any) -> list[str]:
    return list(root.__dict__.get(PIPELINE_CUTS, []))


def pipeline_loss(root: Any) -> Callable | None:
    return root.__dict__.get(PIPELINE_LOSS)


def set_pipeline_loss(root: Any, fn: Callable) -> None:
    root.__dict__[PIPELINE_LOSS] = fn


# Tracer-private marks.
def mark_constructor_wrapper(fn: Callable) -> None:
    setattr(fn, CONSTRUCTOR_WRAPPER, True)


def is_constructor_wrapper(fn: Callable) -> bool:
    return getattr(fn, CONSTRUCTOR_WRAPPER, False)


def error_where(err: BaseException) -> tuple[str, str] | None:
    return getattr(err, ERROR_WHERE, None)


def set_error_where(err: BaseException, where: str, module_class: str) -> None:
    setattr(err, ERROR_WHERE, (where, module_class))
