"""``report_memory``: the memory a rank uses, as upstream Slapo's scripts print it."""

from __future__ import annotations

import gc
import resource
import sys

import torch
import torch.distributed as dist


def report_memory(msg: str = "", report_gc: bool = False) -> dict:
    """Print and return this process's memory: its peak resident memory on the host
    (``cpu_peak_gib``) and, where CUDA is in use, the peak memory allocated on the current
    device since the last report (``device_peak_mib``; the peak is reset). ``report_gc``
    also counts the elements of the tensors the garbage collector still tracks
    (``gc_tensor_elements``)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    scale = 1 if sys.platform == "darwin" else 1024
    report = {"cpu_peak_gib": peak * scale / 2**30}
    line = f"{msg} rank {rank}: CPU peak resident memory {report['cpu_peak_gib']:.4f} GiB"
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        report["device_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
        torch.cuda.reset_peak_memory_stats()
        line += f", device peak allocated {report['device_peak_mib']:.4f} MiB"
    if report_gc:
        gc.collect()
        report["gc_tensor_elements"] = sum(obj.numel() for obj in gc.get_objects()
                                           if issubclass(type(obj), torch.Tensor))
        line += f", {report['gc_tensor_elements']} tensor elements alive"
    print(line.strip(), flush=True)
    return report
