"""``slapo-bench run --profile DIR``: torch.profiler over the timed steps of every rank (or,
with ``--profile-after N``, over N more steps after them, so that the record's figures stay
unprofiled).

Each rank writes ``DIR/rank<R>.txt`` (its operators by self time, CPU and, on CUDA, device),
``DIR/rank<R>.ops.json`` (every operator's calls, self time and, where torch.profiler counts
them (matrix products, element-wise ops), floating-point operations from the shapes; the
steps profiled: what :mod:`slapo_ae.analysis.gaps` compares; and ``by_shape``, the largest
operators by input shapes, which tell where an eager copy comes from) and ``DIR/rank<R>.trace.json``
(a Chrome trace, for ``chrome://tracing`` or Perfetto), and returns a short summary that goes
into the record (``metrics.extra.profile``): the profiled wall time, the self time of
collectives and of the top operators (on CUDA their kernels' time too, ``self_device_us``).
Warm-up steps are not profiled. Profiling slows the steps it watches, so the throughput of a
record whose timed steps were profiled is not comparable with an unprofiled one; the record's
notes say which steps were profiled.
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

# Operator names of collectives and their waits: c10d ops, gloo/NCCL kernels, the autograd
# wrappers of Slapo's sharding ops (_AllReduceForward, ...) and of megatron-core's
# (_ReduceFromModelParallelRegion, LinearWithGradAccumulationAndAsyncCommunication...).
COLLECTIVE = re.compile(r"c10d::|gloo|nccl|record_param_comms|all_?reduce|all_?gather|"
                        r"reduce_?scatter|alltoall|ModelParallelRegion|Communication",
                        re.IGNORECASE)
TOP_OPS = 15
TABLE_ROWS = 60
SHAPED_ROWS = 40  # of ops.json's by_shape


class StepProfiler:
    """Profile from step ``start`` to the end of training: from the first timed step, or (with
    ``--profile-after``) from the first step after them."""

    def __init__(self, out_dir: str | None, rank: int, start: int, cuda: bool):
        self.out_dir, self.rank, self.start, self.cuda = out_dir, rank, start, cuda
        self.prof = None
        self.began = None
        self.steps = 0  # steps profiled so far

    def step_starting(self, step: int) -> None:
        if self.out_dir is None or step != self.start:
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        # FLOPs need the ops' shapes: they tell more matmul work from slower matmuls; the
        # shapes themselves tell which tensors an operator such as an eager copy moved
        self.prof = profile(activities=activities, with_flops=True, record_shapes=True)
        self.prof.__enter__()
        self.began = time.perf_counter()

    def step_finished(self) -> None:
        if self.prof is not None:
            self.steps += 1

    def finish(self) -> dict | None:
        """Stop, write this rank's table and trace, return its summary (None if off)."""
        if self.prof is None:
            return None
        self.prof.__exit__(None, None, None)
        wall_us = (time.perf_counter() - self.began) * 1e6
        out = Path(self.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        averages = self.prof.key_averages()
        sort = "self_cuda_time_total" if self.cuda else "self_cpu_time_total"
        (out / f"rank{self.rank}.txt").write_text(averages.table(sort_by=sort,
                                                                  row_limit=TABLE_ROWS))
        self.prof.export_chrome_trace(str(out / f"rank{self.rank}.trace.json"))
        table = operators(averages, self.cuda)
        shaped = shaped_operators(self.prof.key_averages(group_by_input_shape=True), self.cuda)
        (out / f"rank{self.rank}.ops.json").write_text(json.dumps(
            {"steps": self.steps, "wall_us": wall_us, **table, "by_shape": shaped}, indent=1))
        return summarize(averages, wall_us, table)


def _on_cpu(event) -> bool:
    """An operator (or a ``record_function`` region) the CPU ran; the rest are the device's
    own events: its kernels, and the GPU-side copies of annotations. torch.profiler counts a
    kernel's time twice, as its own event and in the self device time of the CPU operator that
    launched it."""
    from torch.autograd import DeviceType

    return event.device_type == DeviceType.CPU


def operators(averages, cuda: bool) -> dict:
    """``ops``: each CPU-side operator's calls, self CPU time and FLOPs, and on CUDA the time
    of the kernels it launched itself (``self_device_us``, without its child operators'; a
    compiled region's Triton kernels count under their own names); on CUDA also
    ``device_us``, all kernels' time, which those shares add up to (less any kernel no
    operator launched)."""
    ops = {e.key: {"calls": e.count, "self_cpu_us": e.self_cpu_time_total,
                   **({"self_device_us": e.self_device_time_total} if cuda else {}),
                   **({"flops": e.flops} if e.flops else {})}
           for e in averages if _on_cpu(e)}
    if not cuda:
        return {"ops": ops}
    kernels = (e for e in averages if not _on_cpu(e) and not e.is_user_annotation)
    return {"ops": ops, "device_us": sum(e.self_device_time_total for e in kernels)}


def shaped_operators(averages, cuda: bool) -> list[dict]:
    """The :data:`SHAPED_ROWS` largest CPU-side operators by input shapes (``averages`` from
    ``key_averages(group_by_input_shape=True)``), by the time of the kernels each launched
    itself on CUDA, by self CPU time on CPU: each row's operator, input shapes (one list per
    input, empty for a non-tensor), calls and times."""
    measure = "self_device_time_total" if cuda else "self_cpu_time_total"
    rows = sorted((e for e in averages if _on_cpu(e)), key=lambda e: getattr(e, measure),
                  reverse=True)
    return [{"op": e.key, "input_shapes": [list(shape) for shape in e.input_shapes],
             "calls": e.count, "self_cpu_us": e.self_cpu_time_total,
             **({"self_device_us": e.self_device_time_total} if cuda else {})}
            for e in rows[:SHAPED_ROWS]]


def summarize(averages, wall_us: float, table: dict) -> dict:
    """Profiled wall time, collectives' self CPU time, and the top operators (microseconds):
    by self CPU time, and on CUDA (``table``, :func:`operators`' answer, has ``device_us``)
    also by the device time of the kernels each launched."""
    rows = sorted((e for e in averages if _on_cpu(e)), key=lambda e: e.self_cpu_time_total,
                  reverse=True)
    collective = sum(e.self_cpu_time_total for e in rows if COLLECTIVE.search(e.key))
    summary = {
        "wall_us": round(wall_us),
        "self_cpu_us": round(sum(e.self_cpu_time_total for e in rows)),
        "collective_self_cpu_us": round(collective),
        "top_ops": [{"op": e.key, "calls": e.count, "self_cpu_us": round(e.self_cpu_time_total)}
                    for e in rows[:TOP_OPS]],
    }
    if "device_us" in table:
        summary["device_us"] = round(table["device_us"])
        top = sorted(table["ops"].items(), key=lambda kv: kv[1]["self_device_us"], reverse=True)
        summary["top_device_ops"] = [{"op": name, "calls": op["calls"],
                                      "self_device_us": round(op["self_device_us"])}
                                     for name, op in top[:TOP_OPS]]
    return summary
