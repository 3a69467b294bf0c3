"""One rank of a harness run: ``python -m slapo_ae.harness.worker --spec JSON``, started by the
harness (:mod:`slapo_ae.harness.launch`: directly on one node, under torchrun on several).

Each rank initialises ``torch.distributed`` (gloo on CPU, NCCL on CUDA), builds the system of
the case's mode (:mod:`slapo_ae.harness.systems`) from the same seed, and trains ``steps`` steps on
synthetic batches (:func:`slapo_ae.zoo.synthetic_batch`, seed ``spec.case.seed + step``: the same
global batch on every rank, each data-parallel rank taking its slice). Every step is timed
on every rank (CUDA synchronised); a step's time is the slowest rank's. After the last step
the ranks average their losses and gather their peak memory, parameter counts and timelines,
and rank 0 writes the record (:func:`slapo_ae.record.write_record`, atomic).

Every rank also leaves ``<rundir>/rank<R>.json`` with its status, so the parent can tell
what happened when the ranks die before a record is written. Exit codes: 0 (ok or
unsupported), 1 (failed), 3 (out of memory).

Fault injection, for testing the supervision: ``SLAPO_BENCH_FAULT=<kind>[@<rank>][:<where>]``
makes that rank (every rank without ``@``) raise an error (``crash``), raise
``torch.OutOfMemoryError`` (``oom``), really allocate more than any machine holds (``alloc``:
the CPU allocator's error, recorded as ``oom`` too) or stop forever (``hang``), either at the
start of the second step (``:step``, the default) or just before the system is set up
(``:setup``; the other ranks then block in the set-up's first collective).
"""
from __future__ import annotations

import time

_T0 = time.time()  # before the heavy imports: the launch overhead includes them

import argparse  # noqa: E402
import datetime as _dt  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

from slapo_ae.harness.launch import STORE_ENV  # noqa: E402
from slapo_ae.harness.runspec import RunSpec  # noqa: E402
from slapo_ae.harness.supervise import die_with_parent  # noqa: E402

EXIT_OK, EXIT_FAILED, EXIT_OOM = 0, 1, 3
FAULT_ENV = "SLAPO_BENCH_FAULT"
FAULT_STEP = 1  # ":step" faults fire at the start of this step (0-based)


def log(rank: int, message: str) -> None:
    stamp = time.strftime("%H:%M:%S", time.localtime()) + f".{int(time.time() * 1000) % 1000:03d}"
    print(f"[slapo-bench rank {rank}] {stamp} {message}", flush=True)


def write_rank_status(spec: RunSpec, rank: int, status: str, reason: str = "", **extra) -> None:
    if not spec.rundir:
        return
    from slapo_ae.atomic import write_text

    write_text(Path(spec.rundir) / f"rank{rank}.json",
               json.dumps({"rank": rank, "status": status, "reason": reason,
                           "time": time.time(), **extra}))


def leave(code: int) -> int:
    """Exit now, skipping the interpreter's teardown (a few seconds with torch loaded, paid
    for every launch): everything worth keeping is written and flushed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# What the allocators say when memory runs out: CUDA/HIP, and PyTorch's CPU allocator
CPU_OOM_MESSAGE = "can't allocate memory"


def is_oom(err: BaseException) -> bool:
    import torch

    if isinstance(err, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and (
        CPU_OOM_MESSAGE in text
        or ("out of memory" in text and ("cuda" in text or "hip" in text)))


def injected_fault(rank: int, where: str):
    """The fault ``SLAPO_BENCH_FAULT`` asks of this rank at ``where`` ("setup", or "step"
    meaning step ``FAULT_STEP``), or None."""
    value = os.environ.get(FAULT_ENV, "")
    if not value:
        return None
    value, _, at = value.partition(":")
    kind, _, on_rank = value.partition("@")
    if (at or "step") != where or (on_rank and int(on_rank) != rank):
        return None
    return kind


def raise_fault(kind: str, rank: int) -> None:
    import torch

    log(rank, f"{FAULT_ENV}: injecting {kind!r}")
    if kind == "crash":
        raise RuntimeError(f"fault injected by {FAULT_ENV} on rank {rank}")
    if kind == "oom":
        raise torch.OutOfMemoryError(f"fault injected by {FAULT_ENV} on rank {rank}")
    if kind == "alloc":  # a real allocation past any machine's memory (CPU allocator error)
        torch.empty(2**62, dtype=torch.uint8)
    if kind == "hang":
        while True:
            time.sleep(3600)
    raise ValueError(f"{FAULT_ENV}: unknown fault {kind!r} (crash, oom, alloc, hang)")


def model_fields(spec: RunSpec) -> dict:
    """The model's config dict with the run's overrides (for batches and FLOPs)."""
    from slapo_ae.harness.systems.base import hf_overrides
    from slapo_ae.zoo import load_config

    fields = load_config(spec.case.model)
    fields.update(hf_overrides(spec))
    return fields


def step_batch(spec: RunSpec, fields: dict, system, step: int, device="cpu") -> dict:
    """This rank's share of step ``step``'s synthetic batch (the same global batch on every
    rank, seeded by the step; each data-parallel replica takes its micro-batch)."""
    from slapo_ae.zoo import synthetic_batch

    full = synthetic_batch(fields, spec.case.batch_size, spec.case.seq_len,
                           spec.case.dec_seq_len, seed=spec.case.seed + step)
    micro = system.micro_batch()
    lo = system.dp_rank * micro
    return {k: v[lo:lo + micro].to(device) for k, v in full.items()}


def train(system, spec: RunSpec, ctx,
          timeline: dict) -> tuple[list, list, dict | None, list, list | None]:
    """Run every step; return (this rank's loss tensors, step times in s, its profile
    summary when ``spec.profile_dir`` asks for one, its memory in use in bytes at
    :func:`~slapo_ae.harness.metrics.memory_sample_steps`, None where unmeasured, and on CUDA
    the seconds each step's closing synchronize waited, else None)."""
    import torch

    from slapo_ae.harness.metrics import memory_in_use_bytes, memory_sample_steps
    from slapo_ae.harness.profiling import StepProfiler

    fields = model_fields(spec)
    cuda = ctx.device.type == "cuda"
    steps = spec.case.steps
    # the profiled steps: the timed ones, or (profile_after) as many more after them
    profiler = StepProfiler(spec.profile_dir, ctx.rank,
                            steps if spec.profile_after else spec.case.warmup, cuda)
    losses, times = [], []
    # The host's wait at the synchronize that closes a step: how far its launches led the GPU
    # when it had issued the step (near 0: the host's launches bound the step, or the step
    # read a value back near its end). Unprofiled, unlike the profile's syncs, whose overhead
    # shortens the lead.
    sync_waits = [] if cuda else None
    sample_at, memory = memory_sample_steps(steps, spec.case.warmup), []
    for step in range(steps):
        for _ in range(sample_at[:-1].count(step)):  # (the first two coincide at 1 timed step)
            memory.append(memory_in_use_bytes(ctx.device))
        batch = step_batch(spec, fields, system, step, ctx.device)
        fault = injected_fault(ctx.rank, "step") if step == FAULT_STEP else None
        if fault:
            raise_fault(fault, ctx.rank)
        if cuda:
            torch.cuda.synchronize(ctx.device)
        profiler.step_starting(step)
        if step == 0:
            timeline["first_step_start"] = time.time()
        start = time.perf_counter()
        loss = system.train_step(batch)
        if cuda:
            issued = time.perf_counter()
            torch.cuda.synchronize(ctx.device)
            sync_waits.append(time.perf_counter() - issued)
        times.append(time.perf_counter() - start)
        profiler.step_finished()
        if step == 0:
            timeline["first_step_end"] = time.time()
        losses.append(loss)
        if ctx.rank == 0:
            log(0, f"step {step + 1}/{steps}: {times[-1]:.3f} s"
                   f"{' (warm-up)' if step < spec.case.warmup else ''}")
    timeline["train_end"] = time.time()
    memory.append(memory_in_use_bytes(ctx.device))
    for step in range(steps, steps + spec.profile_after):  # not timed, losses not kept
        batch = step_batch(spec, fields, system, step, ctx.device)
        profiler.step_starting(step)
        system.train_step(batch)
        if cuda:
            torch.cuda.synchronize(ctx.device)
        profiler.step_finished()
    if spec.profile_after and ctx.rank == 0:
        log(0, f"{spec.profile_after} more step(s) profiled, untimed")
    return losses, times, profiler.finish(), memory, sync_waits


def measured_attention_kernels() -> list[dict]:
    """The SDPA kernels Slapo's attention measured in this process (none unless a schedule's
    attention ran on a device where it measures; ``slapo.op.sdpa_backend``)."""
    sdpa_backend = sys.modules.get("slapo.op.sdpa_backend")
    return sdpa_backend.measurements() if sdpa_backend is not None else []


def fused_projection_note() -> str | None:
    """What ``compile(fuse_projections=True)`` fused in this process's compiled regions, as a
    note (None when nothing was)."""
    projections = sys.modules.get("slapo.primitives._projections")
    groups = projections.fused_groups() if projections is not None else []
    return projections.describe(groups) if groups else None


def build_record(spec: RunSpec, system, ctx, losses: list[float], gathered: list[dict]):
    """The ``ok`` record from the averaged losses and every rank's numbers."""
    from slapo_ae.harness import deferred_compile, flops, metrics
    from slapo_ae.record import Metrics, Record, collect_env, iso, now

    step_times = [max(rank["step_times"][i] for rank in gathered) for i in range(spec.case.steps)]
    thr = metrics.throughput(step_times, spec.case.batch_size, spec.case.warmup)
    env = collect_env(metrics.device_info())
    budget = spec.thread_budget()
    env.update({"world_size": ctx.world_size, "backend": "nccl" if ctx.device.type == "cuda"
                else "gloo", **budget.as_env_record(), "memory_per_rank": spec.memory_per_rank,
                "threads_in_use": [rank["threads"] for rank in gathered],
                "torch_compile": deferred_compile.summary()})  # rank 0 imports what every rank does
    notes = list(system.notes)
    attention_kernels = measured_attention_kernels()
    if attention_kernels:
        from slapo.op.sdpa_backend import describe
        notes.extend(describe(attention_kernels))
    fused = fused_projection_note()
    if fused:
        notes.append(fused)
    if budget.oversubscribed:
        notes.append(f"oversubscribed: {budget.ranks} ranks on {budget.cores} cores (one "
                     "thread each); the steps measure the cores' time-sharing too")
    memory = {"steps": metrics.memory_sample_steps(spec.case.steps, spec.case.warmup),
              "ranks": [rank["memory"] for rank in gathered]}
    timed_steps_profiled = spec.profile_dir and not spec.profile_after
    if not timed_steps_profiled:  # the profiler's own event buffers grow every step
        leak = metrics.memory_growth_note(memory["ranks"], memory["steps"])
        if leak:
            notes.append(leak)
    if timed_steps_profiled:
        notes.append(f"profiled with torch.profiler (tables and traces in {spec.profile_dir}): "
                     "the timed steps ran slower than unprofiled ones")
    elif spec.profile_dir:
        notes.append(f"profiled with torch.profiler (tables and traces in {spec.profile_dir}): "
                     f"{spec.profile_after} more step(s) after the timed ones, which the "
                     "record's figures leave out")
    try:
        per_sample = flops.train_flops_per_sample(model_fields(spec), spec.case.seq_len,
                                                  spec.case.dec_seq_len, "paper")
    except (KeyError, ValueError) as err:
        per_sample = None
        notes.append(f"no FLOPs count: {err}")
    tflops = (flops.tflops_per_gpu(thr["samples_per_s"], per_sample, spec.case.gpus)
              if per_sample else None)
    mfu = None
    if tflops is not None and spec.case.dtype != "fp32":
        mfu = metrics.mfu(tflops, env.get("device_name"))
    timeline = {"launch": spec.launch_time,
                **{k: min(r["timeline"][k] for r in gathered if k in r["timeline"])
                   for k in gathered[0]["timeline"]}}
    first = timeline.get("first_step_start")
    extra = {
        "system": system.description, "dtype": spec.case.dtype, "device": spec.case.device,
        **system.info(), "seed": spec.case.seed, "lr": spec.case.lr,
        "no_dropout": spec.case.no_dropout,
        "overrides": spec.case.overrides, "flops_formula": "paper", "notes": notes,
        "timeline": timeline, "run_id": spec.run_id,
        "profile": ({str(i): r["profile"] for i, r in enumerate(gathered)}
                    if spec.profile_dir else None),
        # per rank, before the first and the middle timed step and after the last (RSS on
        # CPU, allocated on CUDA): a leak grows it in both halves
        "memory_in_use_bytes": memory,
        "attention_kernels": attention_kernels or None,  # rank 0's (slapo.op.sdpa_backend)
        # per rank, per step (CUDA; None on CPU): the host's wait at the step's closing
        # synchronize, the lead its launches had over the GPU
        "sync_wait_s": ([r["sync_waits"] for r in gathered]
                        if gathered[0].get("sync_waits") is not None else None),
        "launch_to_first_step_s": (first - spec.launch_time
                                   if first and spec.launch_time else None),
    }
    m = Metrics(samples_per_s=thr["samples_per_s"], spread=thr["spread"],
                flops_per_sample=per_sample, tflops_per_gpu=tflops, mfu=mfu,
                peak_mem_bytes=[r["peak_mem"] for r in gathered],
                params=[r["params"] for r in gathered], loss=losses, step_times=step_times,
                warmup_steps=spec.case.warmup, extra=extra)
    status, reason = "ok", ""
    broken = next((i for i, loss in enumerate(losses) if not math.isfinite(loss)), None)
    if broken is not None:  # a throughput of steps that no longer train is no result
        status = "failed"
        reason = (f"the loss is not finite from step {broken} on ({losses[broken]}): the "
                  "training diverged (a learning rate too large, an fp16 overflow) or a kernel "
                  "broke; the step times are kept in the record")
    return Record(status=status, case=spec.case_dict(), reason=reason, metrics=m, env=env,
                  log_path=spec.log, started_at=iso(spec.launch_time), finished_at=now())


def die_with_launcher() -> None:
    """SIGKILL this rank when the process that started it (the harness, or torchrun) dies:
    each rank runs in a session of its own, so a killed launcher would otherwise leave it
    running."""
    import signal

    die_with_parent(signal.SIGKILL)
    if os.getppid() == 1:  # the launcher already gone
        os._exit(EXIT_FAILED)


def cap_memory(spec: RunSpec) -> None:
    """Apply ``--memory-per-rank`` before any heavy import: past it, allocations fail (PyTorch
    says "can't allocate memory"), so the rank records ``oom`` instead of swapping or meeting
    the kernel's OOM killer."""
    if spec.memory_per_rank:
        import resource

        resource.setrlimit(resource.RLIMIT_DATA, (spec.memory_per_rank, spec.memory_per_rank))


def run(spec: RunSpec) -> int:
    die_with_launcher()
    cap_memory(spec)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    timeline = {"worker_start": _T0}
    system = None
    try:
        import torch
        import torch.distributed as dist

        from slapo_ae.harness import deferred_compile, metrics, threads

        deferred_compile.install()  # before the systems import megatron-core or DeepSpeed
        from slapo_ae.harness.systems import Unsupported, check, get_system
        from slapo_ae.harness.systems.base import DistContext
        from slapo_ae.record import write_record

        threads.apply_in_rank(spec.thread_budget())  # before any torch work
        # Dropout and every other draw from the global generator follow the seed too, so that
        # a record is reproducible (weights and batches take the seed explicitly).
        torch.manual_seed(spec.case.seed)

        try:
            if spec.case.device == "cuda":
                device = torch.device("cuda", local)
                torch.cuda.set_device(device)
            else:
                device = torch.device("cpu")
            timeout = _dt.timedelta(seconds=(spec.timeout or 1800) + 60)
            backend = "nccl" if spec.case.device == "cuda" else "gloo"
            store = os.environ.get(STORE_ENV)  # the ranks of one node meet here
            if store:
                dist.init_process_group(backend, init_method=f"file://{store}", rank=rank,
                                        world_size=world, timeout=timeout)
            else:  # torchrun's rendezvous
                dist.init_process_group(backend, timeout=timeout)
            timeline["dist_ready"] = time.time()
            ctx = DistContext(rank, world, local, device)
            check(spec)
            system = get_system(spec.case.mode, spec.case.is_3d)(spec, ctx)
            system.micro_batch()  # the batch split is known before any work
            fault = injected_fault(rank, "setup")
            if fault:
                raise_fault(fault, rank)
            system.setup()
            timeline["setup_done"] = time.time()
            log(rank, f"{spec.case.mode} set up in {timeline['setup_done'] - _T0:.1f} s "
                      f"(dp {system.dp_size}, tp {system.tp_size}); "
                      f"training {spec.case.steps} steps")
            local_losses, times, profile, memory, sync_waits = train(system, spec, ctx,
                                                                     timeline)
        except Unsupported as err:
            reason = str(err)
            log(rank, f"unsupported: {reason}")
            write_rank_status(spec, rank, "unsupported", reason)
            if rank == 0:
                notes = list(system.notes) if system else []
                write_record(spec.non_ok_record("unsupported", reason, notes=notes), spec.out)
            if dist.is_initialized():
                dist.destroy_process_group()
            return leave(EXIT_OK)
        losses = torch.stack(local_losses).to(device)
        dist.all_reduce(losses)  # gloo has no AVG: sum, then divide
        losses = (losses / world).tolist()
        mine = {"peak_mem": metrics.peak_memory_bytes(device), "params": system.params_on_rank(),
                "step_times": times, "timeline": timeline, "threads": threads.threads_in_use(),
                "profile": profile, "memory": memory, "sync_waits": sync_waits}
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            record = build_record(spec, system, ctx, losses, gathered)
            write_record(record, spec.out)
            log(0, f"record written to {spec.out}: {record.metrics.samples_per_s:.3f} samples/s")
        write_rank_status(spec, rank, "ok")
        dist.barrier()
        dist.destroy_process_group()
        log(rank, "done")
        return leave(EXIT_OK)
    except BaseException as err:  # failures are data: tell the parent, then leave at once
        traceback.print_exc()
        summary = (f"{type(err).__name__}: {err}".splitlines()[0][:500] if str(err)
                   else type(err).__name__)
        oom = False
        try:
            oom = is_oom(err)
        except Exception:
            pass
        write_rank_status(spec, rank, "oom" if oom else "failed", f"rank {rank}: {summary}",
                          traceback="\n".join(traceback.format_exc().splitlines()[-30:]))
        leave(EXIT_OOM if oom else EXIT_FAILED)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="the RunSpec as JSON")
    args = parser.parse_args(argv)
    return run(RunSpec.from_json(args.spec))


if __name__ == "__main__":
    sys.exit(main())
