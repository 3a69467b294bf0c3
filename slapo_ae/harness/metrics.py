"""Throughput, spread, MFU and peak memory of a benchmark run.

- per-step throughput: ``samples/s_i = global batch / wall time of step i``;
- reported throughput: the median of the per-step values over the timed steps (the first
  ``warmup`` steps are excluded), with their min, max, quartiles (IQR) and stdev as spread;
- TFLOPS per GPU: :func:`slapo_ae.harness.flops.tflops_per_gpu`;
- MFU = achieved model FLOPS per GPU / the device's peak dense FLOPS (:data:`PEAK_FLOPS`,
  16-bit tensor cores); ``None`` when the device's peak is unknown (CPU).
"""
from __future__ import annotations

import platform
import resource
import statistics
import sys

# Peak dense 16-bit tensor-core FLOPS, matched as substrings of the device name (longest
# first): V100 fp16, A100 bf16/fp16, H100 SXM / PCIe bf16, H200 bf16.
PEAK_FLOPS = {
    "V100": 125e12,
    "A100": 312e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "H200": 989e12,
}


def timed_steps(step_times: list[float], warmup: int) -> list[float]:
    """The step times after the first ``warmup`` steps; at least one must remain."""
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    timed = list(step_times)[warmup:]
    if not timed:
        raise ValueError(f"no timed steps: {len(step_times)} steps, {warmup} warm-up")
    if any(t <= 0 for t in timed):
        raise ValueError(f"step times must be positive, got {timed}")
    return timed


def throughput(step_times: list[float], batch_size: int, warmup: int = 0) -> dict:
    """Samples/s of the timed steps: ``{"samples_per_s": median, "spread": {...}}``.

    ``spread`` holds ``min``, ``max``, ``q1``, ``q3``, ``iqr``, ``stdev`` (0 for one step) of
    the per-step samples/s, and ``steps``, the number of timed steps.
    """
    rates = sorted(batch_size / t for t in timed_steps(step_times, warmup))
    if len(rates) > 1:
        q1, _, q3 = statistics.quantiles(rates, n=4, method="inclusive")
        stdev = statistics.stdev(rates)
    else:
        q1 = q3 = rates[0]
        stdev = 0.0
    spread = {"min": rates[0], "max": rates[-1], "q1": q1, "q3": q3, "iqr": q3 - q1,
              "stdev": stdev, "steps": len(rates)}
    return {"samples_per_s": statistics.median(rates), "spread": spread}


def peak_flops(device_name: str | None) -> float | None:
    """Peak 16-bit FLOPS of a device by name (``"NVIDIA H200"`` -> 989e12); None if unknown."""
    if not device_name:
        return None
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):
        if key.lower() in device_name.lower():
            return PEAK_FLOPS[key]
    return None


def mfu(tflops_per_gpu: float | None, device_name: str | None) -> float | None:
    """Model FLOPS utilization: ``tflops_per_gpu * 1e12 / peak``; None if the peak is unknown."""
    peak = peak_flops(device_name)
    if peak is None or tflops_per_gpu is None:
        return None
    return tflops_per_gpu * 1e12 / peak


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def peak_memory_bytes(device=None) -> int:
    """Peak memory of this rank: CUDA max allocated on a CUDA device, else peak RSS.

    ``device`` is a ``torch.device``, a string such as ``"cuda:0"``/``"cpu"``, or None (CUDA
    if torch is loaded and CUDA is available). torch is only consulted if already imported.
    """
    torch = sys.modules.get("torch")
    if torch is not None:
        dev = torch.device(device) if device is not None else None
        use_cuda = dev.type == "cuda" if dev is not None else torch.cuda.is_available()
        if use_cuda:
            return int(torch.cuda.max_memory_allocated(dev))
    return peak_rss_bytes()


def memory_in_use_bytes(device) -> int | None:
    """Memory this rank holds now: CUDA allocated on a CUDA device, else the resident set
    (Linux ``/proc/self/statm``; None where there is no such file)."""
    import torch

    if torch.device(device).type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return None


# A rank whose memory grows by more than both over the timed steps keeps something of every
# step (a leak): allocator jitter on CPU stays within about 10 MiB on the tiny models, and the
# overlap node's leak of 2026-12-02 grew 2 to 12 MiB a step.
GROWTH_NOTE_MIN_BYTES = 32 * 2**20
GROWTH_NOTE_MIN_BYTES_PER_STEP = 2**20


def memory_growth_note(growth_bytes: list[int | None], timed_steps: int) -> str | None:
    """A note for the record when some rank's memory grew like a leak over the timed steps
    (``growth_bytes`` per rank, None where unmeasured), else None."""
    known = [(g, rank) for rank, g in enumerate(growth_bytes) if g is not None]
    if not known or timed_steps < 1:
        return None
    growth, rank = max(known)
    if growth <= GROWTH_NOTE_MIN_BYTES or growth / timed_steps <= GROWTH_NOTE_MIN_BYTES_PER_STEP:
        return None
    return (f"memory grew {growth / 2**20:.0f} MiB over the {timed_steps} timed steps on rank "
            f"{rank} ({growth / timed_steps / 2**20:.1f} MiB a step): something keeps every "
            "step's tensors (a leak?), and the peak memory grows with the steps")


def device_info() -> dict:
    """Accelerator name and count (CUDA through torch), or the CPU when there is none."""
    import torch

    if torch.cuda.is_available():
        return {"device_name": torch.cuda.get_device_name(0),
                "device_count": torch.cuda.device_count(), "cuda": torch.version.cuda}
    return {"device_name": f"cpu ({platform.machine()})", "device_count": 0, "cuda": None}
