"""Megatron-LM's dialects: its training log's throughput (``log_parser``)."""

from __future__ import annotations

from . import logs, register_framework_dialect


@register_framework_dialect("megatron", "log_parser")
class MegatronLogParser:
    """Megatron-LM logs every ``log_interval`` iterations the mean iteration time of that
    interval (``elapsed time per iteration (ms): X``); the first interval is warm-up and is
    left out when there are others. Samples per second are the global batch size over that
    mean time; memory is the last ``max allocated`` (MB), in GB."""

    @staticmethod
    def parse_log(path) -> tuple[float, float, float, int]:
        text = logs.read(path)
        if (oom := logs.failed(text)) is not None:
            return oom
        times = logs.numbers_after(text, "elapsed time per iteration (ms)", r":\s*")
        batch = logs.numbers_after(text, "global batch size", r":\s*")
        if not times or not batch:
            return 0, 0, 0, 2
        kept = times[1:] if len(times) > 1 else times
        iteration_ms = sum(kept) / len(kept)
        params = logs.numbers_after(
            text, "parameters on (tensor, pipeline) model parallel rank (0, 0)", r":\s*")
        memory = logs.numbers_after(text, "max allocated", r":\s*")
        return (params[-1] if params else 0, batch[-1] / iteration_ms * 1e3,
                memory[-1] / 1e3 if memory else 0, 0)
