"""Benchmark: where a system's step goes, without the profiler (printed per rank).

    .venv/bin/torchrun --standalone --nproc_per_node 2 benchmarks/bench_phases.py \\
        --mode slapo-megatron --model t5-tiny --seq-len 128 --dec-seq-len 64

Builds the harness's system for the case (the global batch 4 x ranks, as in the cpu profile)
and times each step's forward (to the loss), backward and optimizer step with
``time.perf_counter``, one thread a rank; prints the medians over the steps after the warm-up.
torch.profiler slows systems unequally (on t5-tiny at 2 ranks megatron-core's step took about
100 ms more under it, Slapo-TP's 0 to 50), so a gap that the `gaps` profiles do not show can
still be found here (docs/workflow.md: the t5-tiny gap of 2026-12-02 was Slapo-TP's forward,
66 to 69 ms against 47 to 52 with ``--no-comm``, and its cause a leak that slowed every
operator a little, which no operator table singles out). Run the systems one after the
other, alternating, and compare ratios. ``--no-comm`` turns the collectives into no-ops after
set-up: each rank's compute alone, to tell a gap in computation from one in communication (on
t5-tiny at 2 ranks the steps took 210 to 250 ms with the collectives, 110 to 190 without,
2026-12-02). ``--time-comm`` times each collective on every rank and splits a blocking one
into the wait for the last rank to arrive and the rest (docs/workflow.md: gpt-neo-tiny at 2
ranks, 2026-12-03).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from slapo_ae.harness import deferred_compile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--dec-seq-len", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=0,
                        help="the global batch (default 4 x ranks, as in the cpu profile)")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--no-comm", action="store_true",
                        help="replace the collectives by no-ops after set-up: each rank's "
                             "compute alone (the loss is then meaningless)")
    parser.add_argument("--time-comm", action="store_true",
                        help="time each collective on every rank (an async one until its "
                             "wait returns) and print, per phase and call, its op, size, "
                             "median time and, for a blocking one, the wait for the last rank")
    args = parser.parse_args()

    deferred_compile.install()  # as in the harness's ranks
    from slapo_ae.case import Case
    from slapo_ae.harness.runspec import RunSpec
    from slapo_ae.harness.systems import get_system
    from slapo_ae.harness.systems.base import DistContext
    from slapo_ae.harness.worker import model_fields, step_batch

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    global_batch = args.batch_size or 4 * world
    case = Case(mode=args.mode, model=args.model, gpus=world, seq_len=args.seq_len,
                dec_seq_len=args.dec_seq_len, batch_size=global_batch, batch_expr=f"{global_batch}",
                ckpt=None if args.mode == "megatron" else 0.0, steps=args.steps,
                warmup=args.warmup)
    spec = RunSpec(case=case, out="/dev/null")
    system = get_system(args.mode, False)(spec, DistContext(rank, world, rank,
                                                            torch.device("cpu")))
    system.setup()
    if not hasattr(system, "forward_loss"):
        raise SystemExit(f"{args.mode}: not a torch-native trainer (no forward_loss)")
    calls = _skip_collectives() if args.no_comm else None
    comm = _time_collectives() if args.time_comm else None
    fields = model_fields(spec)
    phases = {"forward": [], "backward": [], "optimizer": [], "step": []}
    for step in range(args.steps):
        batch = step_batch(spec, fields, system, step)
        _phase[:] = ["forward", step]
        t0 = time.perf_counter()
        loss = system.forward_loss(batch)
        t1 = time.perf_counter()
        _phase[0] = "backward"
        loss.backward()
        t2 = time.perf_counter()
        _phase[0] = "optimizer"
        system.optimizer.step()
        system.optimizer.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        if step >= args.warmup:
            for name, seconds in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
                phases[name].append(seconds)
    print(f"{args.mode} {args.model} rank {rank}/{world}: " + ", ".join(
        f"{name} {1000 * statistics.median(v):.1f} ms" for name, v in phases.items()),
        flush=True)
    if calls is not None:
        print(f"rank {rank}: collectives skipped a step: {calls[0] / args.steps:.0f}", flush=True)
    if comm is not None:
        print(_comm_table(comm, rank, args.warmup), flush=True)
    dist.destroy_process_group()


_phase = ["set-up", -1]  # the phase and step the collectives run in


def _time_collectives() -> list[tuple]:
    """Wrap torch.distributed's collectives to record (phase, step, op, numel, start, end) per
    call, on the host's monotonic clock (``perf_counter``: one clock for all local ranks); an
    async call ends when its ``wait`` returns."""
    records: list[tuple] = []

    def timed(name, fn):
        def collective(tensor, *args, async_op=False, **kwargs):
            where = tuple(_phase)
            start = time.perf_counter()
            work = fn(tensor, *args, async_op=async_op, **kwargs)
            numel = tensor.numel() if isinstance(tensor, torch.Tensor) else sum(
                t.numel() for t in tensor)
            if not async_op:
                records.append((*where, name, numel, start, time.perf_counter()))
                return work
            return _TimedWork(work, lambda: records.append(
                (*where, name + " (async)", numel, start, time.perf_counter())))
        return collective

    for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor"):
        setattr(dist, name, timed(name, getattr(dist, name)))
    return records


class _TimedWork:
    """An async collective's handle that records its time when ``wait`` returns."""

    def __init__(self, work, record):
        self._work, self._record = work, record

    def wait(self, *args, **kwargs):
        done = self._work.wait(*args, **kwargs)
        self._record()
        return done

    def __getattr__(self, name):
        return getattr(self._work, name)


def _comm_table(records: list[tuple], rank: int, warmup: int) -> str:
    """Per phase, each collective in call order: op, elements and medians over the steps of
    this rank's time in it, split for a blocking call into the wait for the last rank to
    arrive and the rest (the transfer); gathered from all ranks."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, records)  # c10d's own all_gather: not timed
    # (phase, call, op, numel) -> step -> rank -> (start, end)
    calls: dict[tuple, dict[int, dict[int, tuple]]] = {}
    for who, per_rank in enumerate(everyone):
        order: dict[tuple, int] = {}
        for phase, step, name, numel, start, end in per_rank:
            if step < warmup:
                continue
            index = order[step, phase] = order.get((step, phase), -1) + 1
            steps = calls.setdefault((phase, index, name, numel), {})
            steps.setdefault(step, {})[who] = (start, end)
    lines = [f"rank {rank}: collectives (phase, call, op, elements; median ms of time in the "
             "call, of which waiting for the last rank to arrive)"]
    totals: dict[str, list[float]] = {}
    for (phase, index, name, numel), steps in sorted(calls.items()):
        mine = [spans[rank] for spans in steps.values() if rank in spans]
        waits = [max(s for s, _ in spans.values()) - spans[rank][0]
                 for spans in steps.values() if rank in spans]
        time_in = 1000 * statistics.median(end - start for start, end in mine)
        wait = 1000 * statistics.median(waits)
        total = totals.setdefault(phase, [0.0, 0.0])
        total[0] += time_in
        line = f"  {phase:9} {index:2} {name:28} {numel:8} {time_in:6.2f}"
        if "async" not in name:
            total[1] += wait
            line += f"  wait {wait:6.2f}"
        lines.append(line)
    lines.append("  sums: " + ", ".join(f"{p} {t:.1f} ms (waiting {w:.1f})"
                                        for p, (t, w) in totals.items()))
    return "\n".join(lines)


class _Done:
    def wait(self, *args, **kwargs):
        return True

    def is_completed(self):
        return True


def _skip_collectives() -> list[int]:
    """Make torch.distributed's all-reduce, all-gather and reduce-scatter no-ops (outputs
    take this rank's input) and count the calls."""
    calls = [0]

    def counted(fill):
        def collective(*args, async_op=False, **kwargs):
            calls[0] += 1
            fill(*args)
            return _Done() if async_op else None
        return collective

    def gather(outputs, x, *rest):
        for out in outputs:
            out.copy_(x)

    def gather_into(out, x, *rest):
        out.copy_(x.repeat(*([out.shape[0] // x.shape[0]] + [1] * (x.dim() - 1))))

    def scatter_into(out, x, *rest):
        out.copy_(x[:out.shape[0]])

    dist.all_reduce = counted(lambda *a: None)
    dist.all_gather = counted(gather)
    dist.all_gather_into_tensor = dist._all_gather_base = counted(gather_into)
    dist.reduce_scatter_tensor = dist._reduce_scatter_base = counted(scatter_into)
    return calls


if __name__ == "__main__":
    main()
