"""DeepSpeed's dialects: its engine (``runtime_engine``, what ``build(target="deepspeed")``
runs) and its training log's throughput (``log_parser``). ``pipeline`` holds upstream's
helpers for DeepSpeed configs and pipeline process groups."""

from __future__ import annotations

from ...engines import deepspeed_engine
from .. import logs, register_framework_dialect
from . import pipeline  # noqa: F401  (upstream's scripts reach it as an attribute)

register_framework_dialect("deepspeed", "runtime_engine")(deepspeed_engine)


@register_framework_dialect("deepspeed", "log_parser")
class DeepSpeedLogParser:
    """DeepSpeed logs every ``steps_per_print`` steps the running mean throughput since the
    start (``RunningAvgSamplesPerSec=X``, or ``SamplesPerSec=X`` in older releases). With
    several reports the first interval is warm-up: the throughput of the others is their
    samples over their time, ``(n - 1) / (n / a_n - 1 / a_1)`` for running means
    ``a_1 .. a_n`` over equal intervals. Memory is the last ``MaxMemAllocated`` (GB)."""

    @staticmethod
    def parse_log(path) -> tuple[float, float, float, int]:
        text = logs.read(path)
        if (oom := logs.failed(text)) is not None:
            return oom
        means = logs.numbers_after(text, "RunningAvgSamplesPerSec", "=") or \
            logs.numbers_after(text, "SamplesPerSec", "=")
        if not means or not all(means):
            return 0, 0, 0, 2
        n = len(means)
        samples_per_sec = means[0] if n == 1 else (n - 1) / (n / means[-1] - 1 / means[0])
        memory = logs.numbers_after(text, "MaxMemAllocated", "=")
        return 0, samples_per_sec, memory[-1] if memory else 0, 0
