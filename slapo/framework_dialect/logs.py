"""Reading throughput from a framework's training log (the ``log_parser`` dialects).

Each parser returns upstream Slapo's tuple ``(params_per_gpu, samples_per_sec, gpu_mem_gb,
error_code)``: error 1 when the log reports running out of memory, 2 when it holds no
throughput (the run failed); the numbers are then 0.
"""

from __future__ import annotations

import re
from pathlib import Path

OUT_OF_MEMORY = ("CUDA out of memory", "OutOfMemoryError")


def numbers_after(text: str, key: str, separator: str) -> list[float]:
    """Every number that follows ``key`` and ``separator`` in ``text``, in order."""
    return [float(v) for v in re.findall(re.escape(key) + separator + r"([\d.]+)", text)]


def read(path) -> str:
    return Path(path).read_text(encoding="utf-8", errors="replace")


def failed(text: str) -> tuple[float, float, float, int] | None:
    """The result for a log of an out-of-memory run, else None."""
    if any(marker in text for marker in OUT_OF_MEMORY):
        return 0, 0, 0, 1
    return None
