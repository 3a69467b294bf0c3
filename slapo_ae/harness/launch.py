"""The parent side of a harness run: launch the ranks with torchrun, supervise, and make sure
exactly one record results.

    record = launch.run(spec)

1. The system's cheap check runs here first; an ``unsupported`` case (torchscript, a model the
   system lacks, 16-bit on CPU, more GPUs than visible, more CPU ranks than the machine holds:
   :func:`slapo_ae.harness.threads.cpu_rank_limit`) is recorded without launching.
2. The ranks start (:func:`rank_commands`), each in a session of its own, stdout and stderr
   to the log file. On one node the parent starts ``python -m slapo_ae.harness.worker --spec
   JSON`` once per rank itself, the ranks meeting through a file store in the launch's folder;
   on several nodes ``python -m torch.distributed.run`` (torchrun) is each node's agent, the
   agents meeting at a c10d rendezvous.
3. The parent waits up to ``spec.timeout`` seconds; past it, it kills the ranks (and torchrun)
   (SIGTERM, then SIGKILL) and records ``failed`` with reason ``timeout``. When one rank (or
   agent) fails, the others are stopped, as torchrun stops a failed run's workers. Each
   child gets SIGTERM if the parent dies, and each rank SIGKILL if its parent (the harness or
   torchrun) dies, so no launch outlives the harness.
4. If rank 0 wrote the record of this launch (its ``metrics.extra.run_id`` matches), that is
   the result. Otherwise the parent writes one from the ranks' status files and the exit
   code: ``oom`` if a rank ran out of memory (or the kernel's OOM killer ended a process during
   the run: :func:`oom_kills`), else ``failed``. The reason's first line says
   what happened; the failing rank's traceback and the tail of the log follow it.
"""
from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

from slapo_ae import gpus, paths
from slapo_ae.harness.runspec import RunSpec
from slapo_ae.harness.supervise import supervise_all
from slapo_ae.harness.threads import cpu_rank_limit, proc_number, thread_env
from slapo_ae.record import Record, RecordError, read_record, write_record

LOG_TAIL_LINES = 20
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def worker_env(spec: RunSpec) -> dict:
    """The ranks' environment: offline, the case's thread budget whatever the caller's
    environment holds (:mod:`slapo_ae.harness.threads`), DeepSpeed's extension cache in
    ``.cache/torch_extensions`` of the checkout unless ``TORCH_EXTENSIONS_DIR`` is set, and, for
    a case on CPU, no GPU visible: on a GPU machine a CPU case would otherwise start CUDA
    (random streams, DeepSpeed's accelerator) and its record name the GPU."""
    env = dict(os.environ)
    for key, value in OFFLINE_ENV.items():
        env.setdefault(key, value)
    env.update(thread_env(spec.thread_budget()))
    env.setdefault("TORCH_EXTENSIONS_DIR", str(paths.TORCH_EXTENSIONS))
    if spec.case.device != "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


WORKER = ["-m", "slapo_ae.harness.worker"]
# The file store a one-node launch's ranks meet through (``file://`` init of torch.distributed)
STORE_ENV = "SLAPO_BENCH_STORE"


def torchrun_command(spec: RunSpec) -> list[str]:
    """torchrun for this node's ranks of a case on several nodes: one agent per node meeting
    the others at ``spec.rdzv_endpoint`` (c10d rendezvous, id ``run_id``), ranks numbered by
    the rendezvous."""
    case = spec.case
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(case.nodes),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", spec.rdzv_endpoint,
            "--rdzv-id", spec.run_id, "--nproc_per_node", str(case.gpus_per_node), *WORKER,
            "--spec", spec.to_json()]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (``""``: on every interface): the rendezvous of agents
    started at once (:mod:`slapo_ae.harness.runner`), ``MASTER_PORT`` of a one-node launch."""
    import socket

    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def rank_commands(spec: RunSpec, env: dict) -> list[tuple[list[str], dict]]:
    """``(command, environment)`` of each process this launch starts. Several nodes: this
    node's torchrun agent. One node: every rank directly, with the variables torchrun would
    give it; they meet through a file store in the launch's folder, which no other launch
    can take (a free port could be). torchrun's agent would cost 2 to 3 s of every case
    (its own torch import) and do nothing a run that never restarts needs: the parent
    already stops the other ranks when one fails and all of them at the timeout.
    ``MASTER_ADDR``/``MASTER_PORT`` are set too, for libraries that look for them
    (DeepSpeed's ``init_distributed``); the process group is up before they look."""
    if spec.case.nodes > 1:
        return [(torchrun_command(spec), env)]
    world = spec.case.gpus
    common = {**env, "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
              "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
              STORE_ENV: str(Path(spec.rundir) / "store")}
    command = [sys.executable, *WORKER, "--spec", spec.to_json()]
    return [(command, {**common, "RANK": str(rank), "LOCAL_RANK": str(rank)})
            for rank in range(world)]


def log_tail(path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - 64 * 1024))
            text = handle.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def last_progress(path) -> str | None:
    """The last progress line a rank printed (``[slapo-bench rank R] ...``), if any."""
    lines = [line for line in log_tail(path, 10_000).splitlines()
             if line.startswith("[slapo-bench rank")]
    return lines[-1] if lines else None


def _read_rank_files(rundir: Path) -> list[dict]:
    import json

    found = []
    for path in sorted(rundir.glob("rank*.json")):
        try:
            found.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(found, key=lambda r: r.get("time", 0))


def own_record(spec: RunSpec) -> Record | None:
    """The record at ``spec.out`` if rank 0 of this launch wrote it."""
    if not Path(spec.out).exists():
        return None
    try:
        record = read_record(spec.out)
    except RecordError:
        return None
    return record if record.metrics.extra.get("run_id") == spec.run_id else None


def _exit_text(rc: int) -> str:
    if rc < 0:
        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with code {rc}"


def launcher(spec: RunSpec) -> str:
    """What the parent waited for, as the reasons name it."""
    return "torchrun" if spec.case.nodes > 1 else "a rank"


def oom_kills() -> int | None:
    """How many processes the kernel's OOM killer has ended since boot (``oom_kill`` of
    ``/proc/vmstat``), None where the kernel does not say."""
    return proc_number("/proc/vmstat", "oom_kill")


def conclude(spec: RunSpec, rc: int | None, timed_out: bool, rundir: Path,
             oom_killed: tuple[int, int] | None = None) -> Record:
    """The record of a finished (or killed) launch: rank 0's own, or one made here.
    ``oom_killed``: the kernel's OOM-kill count before and after the launch, when it rose (a
    rank that memory ran out for dies by SIGKILL, leaving no status of its own)."""
    own = own_record(spec)
    if own is not None:
        return own
    ranks = _read_rank_files(rundir)
    tail = log_tail(spec.log) if spec.log else ""
    rank_status = {str(r["rank"]): r["status"] for r in ranks}
    first_failure = next((r for r in ranks if r["status"] in ("oom", "failed")), None)
    if timed_out:
        status = "failed"
        head = (f"timeout: killed after {spec.timeout:g} s (a hung collective, or a run slower "
                f"than --timeout)")
        progress = last_progress(spec.log) if spec.log else None
        head += f"; last progress: {progress}" if progress else "; no rank reported progress"
    else:
        ooms = [r for r in ranks if r["status"] == "oom"]
        failed = [r for r in ranks if r["status"] == "failed"]
        if ooms:
            status, head = "oom", f"out of memory: {ooms[0]['reason']}"
        elif failed:
            status, head = "failed", f"{failed[0]['reason']} ({launcher(spec)} {_exit_text(rc)})"
        elif oom_killed:
            status = "oom"
            head = (f"out of memory: the kernel's OOM killer ended a process during the run "
                    f"(oom_kill {oom_killed[0]} -> {oom_killed[1]} in /proc/vmstat, counted "
                    f"machine-wide) and {launcher(spec)} {_exit_text(rc)} before a record was "
                    f"written")
        else:
            status = "failed"
            head = f"{launcher(spec)} {_exit_text(rc)} before a record was written"
    reason = head
    if first_failure and first_failure.get("traceback") and not timed_out:
        reason += f"\n--- rank {first_failure['rank']} traceback ---\n{first_failure['traceback']}"
    if tail:
        reason += f"\n--- log tail ({spec.log}) ---\n{tail}"
    return spec.non_ok_record(status, reason, exit_code=rc, timed_out=timed_out,
                              rank_status=rank_status)


def launch(spec: RunSpec) -> Record | None:
    """Run the ranks of ``spec`` and return the record (written to ``spec.out``). On one of
    several nodes whose ranks all finished without rank 0 among them, None: rank 0's node
    writes the record (to its ``spec.out``; the same file where the nodes share a file
    system)."""
    spec.run_id = spec.run_id or uuid.uuid4().hex
    log_path = Path(spec.log)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    rundir = Path(tempfile.mkdtemp(prefix="slapo-bench-"))
    spec.rundir = str(rundir)
    try:
        with open(log_path, "w") as log:
            spec.launch_time = time.time()
            started = rank_commands(spec, worker_env(spec))
            cmd = started[0][0]
            log.write(f"# slapo-bench: {spec.case_dict()['id']} (run {spec.run_id})\n"
                      f"# {len(started)} x {' '.join(cmd[:cmd.index('--spec')])} ... "
                      f"(timeout {spec.timeout:g} s)\n")
            log.flush()
            kills_before = oom_kills()
            # a stop signal raises Interrupted once the ranks are stopped (the CLI says so)
            outcome = supervise_all([c for c, _ in started], envs=[e for _, e in started],
                                    timeout=spec.timeout, stdout=log)
            rc, timed_out = outcome.returncode, outcome.timed_out
            ended = _exit_text(rc) if rc is not None else "was killed"
            log.write(f"# slapo-bench: {launcher(spec) if rc else 'the ranks'} {ended}"
                      f"{' after the timeout' if timed_out else ''}\n")
        kills_after = oom_kills()
        if (spec.case.nodes > 1 and rc == 0 and not timed_out
                and own_record(spec) is None):
            return None  # rank 0 ran on another node
        rose = (kills_before is not None and kills_after is not None
                and kills_after > kills_before)
        record = conclude(spec, rc, timed_out, rundir,
                          (kills_before, kills_after) if rose else None)
        if own_record(spec) is None:
            write_record(record, spec.out)
        return record
    finally:
        for path in rundir.glob("*"):
            path.unlink(missing_ok=True)
        rundir.rmdir()


def run(spec: RunSpec) -> Record | None:
    """Check ``spec`` against its system, then launch it; returns the written record (None on
    a node of several that did not host rank 0: :func:`launch`)."""
    from slapo_ae.harness.systems import Unsupported, check

    spec.run_id = spec.run_id or uuid.uuid4().hex
    reason = None
    local = spec.case.gpus_per_node  # the ranks this machine runs
    here = " on this node" if spec.case.nodes > 1 else ""
    if spec.case.device == "cuda":
        visible = gpus.visible_gpus()
        if local > visible:
            reason = f"needs {local} GPUs{here}, {visible} visible"
    else:
        limit, rule = cpu_rank_limit()
        if local > limit:
            reason = (f"needs {local} CPU ranks{here}; this machine holds at most {limit} "
                      f"({rule})")
    if reason is None:
        try:
            check(spec)
        except Unsupported as err:
            reason = str(err)
    if reason is not None:
        spec.launch_time = time.time()
        record = spec.non_ok_record("unsupported", reason)
        if spec.log:
            Path(spec.log).parent.mkdir(parents=True, exist_ok=True)
            Path(spec.log).write_text(f"# slapo-bench: {spec.case_dict()['id']}: unsupported, "
                                      f"not launched: {reason}\n")
        write_record(record, spec.out)
        return record
    return launch(spec)
