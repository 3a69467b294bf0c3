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
# first): V100 fp16, A100 bf16/fp16, H100 and H200 bf16 (SXM; the PCIe and NVL cards, whose
# names say so, have lower clocks or power: NVIDIA's data sheets, halving the sparse figures).
PEAK_FLOPS = {
    "V100": 125e12,
    "A100": 312e12,
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H100": 989e12,
    "H200 NVL": 835e12,
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


def memory_sample_steps(steps: int, warmup: int) -> list[int]:
    """The steps before which a rank samples its memory in use, the last entry meaning after
    the last step: the first timed step, the middle of the timed steps, the end."""
    return [warmup, warmup + (steps - warmup) // 2, steps]


# A leak grows memory in both halves of the timed steps alike; the allocator's warm-up, which
# on CPU can add 50 MiB to the resident set over the first 24 steps and then stay flat
# (slapo-tp-attn-ffn, bert-tiny, 2 ranks, batch 16), grows it in the first half only. The
# overlap node's leak of 2026-12-02 grew 2 to 12 MiB a step.
LEAK_MIN_BYTES = 32 * 2**20
LEAK_MIN_BYTES_PER_STEP = 2**20


def memory_growth_note(samples: list[list[int] | None], sample_steps: list[int]) -> str | None:
    """A note for the record when some rank's memory in use grew like a leak over the timed
    steps, else None. ``samples``: per rank, its memory at ``sample_steps``
    (:func:`memory_sample_steps`), or None where unmeasured."""
    first, middle, last = sample_steps
    if not first < middle < last:
        return None
    worst = None
    for rank, sample in enumerate(samples):
        if sample is None or None in sample:
            continue
        growth = sample[2] - sample[0]
        halves = ((sample[1] - sample[0]) / (middle - first),
                  (sample[2] - sample[1]) / (last - middle))
        if (growth > LEAK_MIN_BYTES and min(halves) > LEAK_MIN_BYTES_PER_STEP
                and (worst is None or growth > worst[0])):
            worst = (growth, rank)
    if worst is None:
        return None
    growth, rank = worst
    steps = last - first
    return (f"memory grew {growth / 2**20:.0f} MiB over the {steps} timed steps on rank {rank} "
            f"({growth / steps / 2**20:.1f} MiB a step, in both halves): something keeps "
            "every step's tensors (a leak?), and the peak memory grows with the steps")


def device_info() -> dict:
    """Accelerator name and count (CUDA through torch), or the CPU when there is none; with
    the cuDNN version torch loaded (which of SDPA's attention kernels PyTorch prefers depends
    on it: ``slapo.op.sdpa_backend``)."""
    import torch

    if torch.cuda.is_available():
        return {"device_name": torch.cuda.get_device_name(0),
                "device_count": torch.cuda.device_count(), "cuda": torch.version.cuda,
                "cudnn": torch.backends.cudnn.version()}
    return {"device_name": f"cpu ({platform.machine()})", "device_count": 0, "cuda": None,
            "cudnn": None}
