"""Framework dialects: what ``build`` and upstream Slapo's scripts look up by framework name
(upstream Slapo's ``slapo.framework_dialect``).

A dialect is registered under a kind and a target framework and fetched with
``get_dialect_cls(kind, target)``:

- ``"runtime_engine"``: ``fn(model, **kwargs) -> (engine, optimizer)``; ``None`` returns the
  model and no optimizer, ``"deepspeed"`` is ``deepspeed.initialize`` (``build(sch,
  target="deepspeed", config=...)``);
- ``"log_parser"``: a class whose ``parse_log(path)`` reads a training log of
  ``"deepspeed"`` or ``"megatron"`` into ``(params_per_gpu, samples_per_sec, gpu_mem_gb,
  error_code)`` (error 0: parsed, 1: out of memory, 2: no throughput in the log);
- ``"pipeline_stage"``, ``"pipeline_engine"``: none. ``build`` makes pipelines itself: on
  DeepSpeed's pipeline engine as upstream did (``build(sch, target="deepspeed",
  topology=..., config=..., loss_fn=...)`` of a schedule with cuts,
  ``slapo.pipeline.deepspeed_pipe``), or on ``torch.distributed.pipelining``
  (``build(sch, target="pipeline", topology=slapo.Topology(dp=, pp=, tp=))``).

Importing this package imports no framework; a dialect imports its framework when it runs.
"""

from __future__ import annotations

from collections.abc import Callable

KINDS = ("pipeline_stage", "pipeline_engine", "runtime_engine", "log_parser")
_DIALECTS: dict[str, dict[str | None, Callable]] = {kind: {} for kind in KINDS}


def _check_kind(kind: str) -> None:
    if kind not in _DIALECTS:
        raise ValueError(f"unknown dialect kind {kind!r}; expected one of {', '.join(KINDS)}")


def register_framework_dialect(target: str | None, kind: str) -> Callable:
    """Decorator: register the decorated class or function as ``target``'s ``kind``."""
    _check_kind(kind)

    def register(dialect):
        if target in _DIALECTS[kind]:
            raise ValueError(f"a {kind} dialect for {target!r} is registered already")
        _DIALECTS[kind][target] = dialect
        return dialect

    return register


def get_all_dialects(kind: str) -> dict[str | None, Callable]:
    """The dialects of ``kind``, by target."""
    _check_kind(kind)
    return dict(_DIALECTS[kind])


def get_dialect_cls(kind: str, target: str | None, allow_none: bool = False) -> Callable:
    """The dialect of ``kind`` for ``target``; with ``allow_none``, the default one (target
    None) when ``target`` has none."""
    _check_kind(kind)
    dialects = _DIALECTS[kind]
    if target in dialects:
        return dialects[target]
    if allow_none and None in dialects:
        return dialects[None]
    if kind.startswith("pipeline_"):
        raise ValueError(f"no {kind} dialect for {target!r}: build makes pipelines itself, "
                         "on DeepSpeed's engine with build(sch, target='deepspeed', "
                         "topology=, config=, loss_fn=) of a schedule with cuts, or on "
                         "torch.distributed.pipelining with build(sch, target='pipeline', "
                         "topology=slapo.Topology(dp=, pp=, tp=))")
    known = ", ".join(repr(t) for t in dialects) or "none"
    raise ValueError(f"no {kind} dialect for {target!r}; registered: {known}")


@register_framework_dialect(None, "runtime_engine")
def plain_engine(model, **kwargs):
    """No framework: the model itself, and no optimizer."""
    return model, None


from . import deepspeed, megatron  # noqa: E402  (registers their dialects)

__all__ = ["KINDS", "deepspeed", "get_all_dialects", "get_dialect_cls", "megatron",
           "register_framework_dialect"]
