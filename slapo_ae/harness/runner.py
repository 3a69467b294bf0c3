"""The workflow's case runner: run one case through the harness CLI; one record results.

    python -m slapo_ae.harness.runner --case JSON --timeout S --out REC.json \\
        --log CASE.log [--harness "python -m slapo_ae.harness.cli"] [--slots-dir D --slots-total T]
        [--nodes-via local|srun]

``--case`` is the case with its run settings (:meth:`slapo_ae.case.Case.to_json`, the job's
params), ``--timeout`` its time limit in seconds. GPU slots come from ``--slots-dir`` and
``--slots-total`` or the environment the workflow sets (``SLAPO_GPU_SLOTS_DIR``,
``SLAPO_GPU_SLOTS_TOTAL``). The runner

1. on CUDA, takes the case's GPUs from the slot allocator (:mod:`.gpu_slots`) and sets
   ``CUDA_VISIBLE_DEVICES``; a case needing more GPUs than the machine has is recorded as
   ``unsupported`` without running; on CPU it hides CUDA (``CUDA_VISIBLE_DEVICES=""``) and
   takes the machine's one CPU slot (:func:`cpu_lock_dir`), which the harness holds while it
   runs, so that no two CPU measurements overlap;
2. runs ``<harness> run --mode ... --cores C --out REC.json --log CASE.log`` with the
   offline environment, in its own process group, under a hard timeout (the case's timeout
   plus ``--grace``, default :data:`GRACE_S`); ``--cores`` (the rule's ``rank_cores``: one
   per rank on CPU) is what the harness shares among the case's ranks, whatever
   ``OMP_NUM_THREADS`` the job inherited;
3. if the harness left no valid record (it crashed, was killed, timed out), writes a
   ``failed`` record itself, with the reason and the log path: failures are data, and a
   failing case never stops the figures of the others.

A case on several nodes (``nodes`` > 1) runs one harness (one torchrun agent) per node, all
meeting at one c10d rendezvous (``slapo-bench run --nodes K --rdzv-endpoint HOST:PORT``); the
agent that hosts rank 0 writes the record. ``--nodes-via`` (default ``$SLAPO_NODES_VIA``, which
the workflow's planner sets from the config, else ``local``) says where the agents run:

- ``local``: all K on this machine, at a free port of 127.0.0.1, supervised together
  (:func:`~slapo_ae.harness.supervise.supervise_all`: when one fails the others are
  stopped); agent ``i`` > 0 logs to ``CASE.node<i>.log`` beside the case log, and on CUDA each
  takes its own share of the GPUs the runner was given;
- ``srun``: one per node of the Slurm job this runs in, through ``scripts/srun_case.sh``
  (``SLAPO_CASE_NODES`` = K, so a job on fewer machines runs the agents as tasks on them).

The timeout, the interrupt handling and the one record are the same as for one node.

If the runner itself is interrupted (SIGINT/SIGTERM/SIGHUP, e.g. Snakemake being stopped, or
killed: the runner asks for its parent's death signal), also while it waits for its slot, it
stops the harness and exits 128 + signal without writing a record, so the case reruns next
time (a record the harness had written before it was stopped is kept: a finished result).
Records are only ever written atomically (:func:`slapo_ae.record.write_record`).
"""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path

from slapo_ae import gpus, paths
from slapo_ae.case import Case, CaseError
from slapo_ae.harness.gpu_slots import GpuSlots
from slapo_ae.harness.launch import OFFLINE_ENV as HARNESS_OFFLINE_ENV
from slapo_ae.harness.launch import free_port
from slapo_ae.harness.supervise import (
    Interrupted,
    die_with_parent,
    raise_on_stop_signals,
    supervise_all,
)
from slapo_ae.record import RecordError, collect_env, non_ok, now, read_record, write_record

GRACE_S = 120  # the hard timeout is the case's timeout plus this
DEFAULT_HARNESS = "python -m slapo_ae.harness.cli"
# Where the GPU slots are: set by the workflow's planner for the jobs, read here.
SLOTS_DIR_ENV = "SLAPO_GPU_SLOTS_DIR"
SLOTS_TOTAL_ENV = "SLAPO_GPU_SLOTS_TOTAL"
# Where the agents of a case on several nodes run (module docstring): set by the planner.
NODES_VIA_ENV = "SLAPO_NODES_VIA"
NODES_VIA = ("local", "srun")
SRUN_CASE = paths.ROOT / "scripts" / "srun_case.sh"
# CPU cases take the machine's one CPU slot, a lock that the harness holds as long as it runs:
# no two CPU measurements overlap, whichever workflow (or orphan of a killed one) started them.
CPU_LOCK_DIR_ENV = "SLAPO_CPU_LOCK_DIR"


def cpu_lock_dir() -> str:
    """``$SLAPO_CPU_LOCK_DIR`` or a per-user folder in the temp directory (machine-wide)."""
    tmp = os.environ.get("TMPDIR", "/tmp")
    user = os.environ.get("USER") or str(os.getuid())
    return os.environ.get(CPU_LOCK_DIR_ENV) or str(Path(tmp) / f"slapo-cpu-{user}")
# The harness's own environment (offline), and no DeepSpeed op builds.
OFFLINE_ENV = {**HARNESS_OFFLINE_ENV, "DS_BUILD_OPS": "0"}


def harness_program(harness: str) -> list[str]:
    """The harness CLI's words (``python`` is this interpreter)."""
    cmd = shlex.split(harness)
    if cmd and cmd[0] in ("python", "python3"):
        cmd[0] = sys.executable
    return cmd


def run_options(case: Case, timeout: float, out: str, log: str,
                cores: int | None = None) -> list[str]:
    """The ``slapo-bench run`` options of ``case`` (its argv, the time limit, ``cores``: the
    CPU cores the case's ranks on one machine share, None for the harness's default,
    :func:`slapo_ae.harness.threads.default_cores`; the record and the log)."""
    return [*case.to_argv(), "--timeout", f"{timeout:g}",
            *(["--cores", str(cores)] if cores else []), "--out", out, "--log", log]


def harness_command(harness: str, case: Case, timeout: float, out: str, log: str,
                    cores: int | None = None) -> list[str]:
    """The harness CLI call for ``case`` (``slapo-bench run`` contract)."""
    return harness_program(harness) + ["run", *run_options(case, timeout, out, log, cores)]


def node_log(log: str, node: int) -> str:
    """The log of agent ``node`` of a case on several nodes: the case log for the first,
    ``CASE.node<i>.log`` beside it for the others."""
    if node == 0:
        return log
    path = Path(log)
    return str(path.with_name(f"{path.stem}.node{node}{path.suffix}"))


def agents(case: Case, harness: str, timeout: float, out: str, log: str, cores: int | None,
           env: dict, nodes_via: str = "local") -> list[tuple[list[str], dict]]:
    """``(command, environment)`` of each process that runs ``case``: the harness alone on one
    node; on several, their agents as ``nodes_via`` says (module docstring)."""
    if case.nodes == 1:
        return [(harness_command(harness, case, timeout, out, log, cores), env)]
    if nodes_via == "srun":  # the script sets --nodes and --rdzv-endpoint itself
        options = run_options(case, timeout, out, log, cores)
        at = options.index("--nodes")
        del options[at:at + 2]
        # this runs on the job's first node, which hosts the rendezvous
        return [([str(SRUN_CASE), *options],
                 {**env, "SLAPO_HARNESS": shlex.join(harness_program(harness)),
                  "SLAPO_CASE_NODES": str(case.nodes), "SLAPO_RDZV_PORT": str(free_port(""))})]
    if nodes_via != "local":
        raise ValueError(f"nodes_via {nodes_via!r}: one of {', '.join(NODES_VIA)}")
    endpoint = f"127.0.0.1:{free_port()}"
    devices = gpus.visible_ids(env.get("CUDA_VISIBLE_DEVICES")) or []
    per_node = case.gpus_per_node
    found = []
    for node in range(case.nodes):
        agent_env = dict(env)
        if case.device == "cuda" and devices:  # each agent its own node's worth of the GPUs
            agent_env["CUDA_VISIBLE_DEVICES"] = ",".join(
                devices[node * per_node:(node + 1) * per_node])
        cmd = harness_command(harness, case, timeout, out, node_log(log, node), cores)
        found.append((cmd + ["--rdzv-endpoint", endpoint], agent_env))
    return found


def write_own_record(case: Case, out: str, log: str, status: str, reason: str,
                     visible: str | None = None, started: str | None = None) -> None:
    write_record(non_ok(case.to_record(), status, reason, log_path=log, started_at=started,
                        env=collect_env(gpus.describe(case.device, case.gpus, visible)),
                        extra={"recorded_by": "slapo_ae.harness.runner"}), out)


def _valid_record(out: str) -> bool:
    if not Path(out).is_file():
        return False
    try:
        read_record(out)
    except RecordError:
        return False
    return True


class _Notes:
    """The runner's own log lines, and the harness's stdout/stderr (kept in a temporary
    file). The harness writes the case log itself (``--log``, truncating it), so both are
    appended to that log once the harness has exited."""

    def __init__(self, log: str):
        self.log = log
        self.lines = []
        self.output = tempfile.TemporaryFile(mode="w+")

    def __call__(self, text: str) -> None:
        self.lines.append(f"[runner {now()}] {text}")

    def flush(self) -> None:
        self.output.seek(0)
        captured = self.output.read()
        with open(self.log, "a") as handle:
            handle.write("\n# --- slapo_ae.harness.runner ---\n")
            handle.write("\n".join(self.lines) + "\n")
            if captured.strip():
                handle.write("# --- harness stdout/stderr ---\n" + captured)
                if not captured.endswith("\n"):
                    handle.write("\n")
        self.lines = []
        self.output.close()


def run(case: Case, timeout: float, out: str, log: str, harness: str = DEFAULT_HARNESS,
        slots_dir: str | None = None, slots_total: int | None = None,
        grace: float = GRACE_S, cores: int | None = None, nodes_via: str = "local") -> int:
    """Run the case; returns 0 once a record is at ``out`` (see the module docstring)."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(log).parent.mkdir(parents=True, exist_ok=True)
    Path(out).unlink(missing_ok=True)  # only a record of this run counts
    Path(log).write_text("")
    note = _Notes(log)
    # a stop signal, while waiting for a slot or for the harness (which is then stopped),
    # raises Interrupted and leaves the runner deaf to further ones (supervise.py)
    previous = raise_on_stop_signals()
    interrupted = False
    try:
        return _run(case, timeout, out, log, harness, slots_dir, slots_total, grace, cores,
                    nodes_via, note)
    except Interrupted as err:
        interrupted = True  # and deaf to stop signals until it exits
        if _valid_record(out):  # a finished result, written as the harness shut down: kept
            note(f"interrupted (signal {err.signum}) after the harness wrote its record at "
                 f"{out}; the record is kept")
        else:
            note(f"interrupted (signal {err.signum}); no record written, the case will rerun")
        return 128 + err.signum
    finally:
        note.flush()
        if not interrupted:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def harness_env() -> dict:
    """The harness's environment: this one, offline, DeepSpeed's extension cache in
    ``.cache/torch_extensions`` unless set, and this checkout first on ``PYTHONPATH``."""
    env = dict(os.environ)
    for key, value in OFFLINE_ENV.items():
        env.setdefault(key, value)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(paths.TORCH_EXTENSIONS))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))
    return env


def hold_device(case, env: dict, slots_dir: str | None, slots_total: int | None):
    """Hold what ``case`` runs on and show its ranks only that, in ``env``: on CPU the machine's
    one CPU slot (CPU cases never measure beside each other) and no GPU; on CUDA its GPUs of
    the workflow's slots, where it set them and the case fits (one that needs more is the
    caller's to record unsupported). Returns the allocation (release it; its lock fds pass to
    the harness), or None where nothing is held."""
    if case.device != "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ""
        return GpuSlots(cpu_lock_dir(), 1).acquire(1)
    if not slots_dir or slots_total is None or case.gpus > slots_total:
        return None
    alloc = GpuSlots(slots_dir, slots_total,
                     os.environ.get("CUDA_VISIBLE_DEVICES")).acquire(case.gpus)
    env["CUDA_VISIBLE_DEVICES"] = alloc.visible_devices
    return alloc


def _run(case, timeout, out, log, harness, slots_dir, slots_total, grace, cores, nodes_via,
         note) -> int:
    started = now()
    env = harness_env()
    note(f"case {case.id}: {case.to_json()}")
    if case.device == "cuda" and slots_total is not None and slots_dir \
            and case.gpus > slots_total:
        reason = f"needs {case.gpus} GPUs, this machine offers {slots_total}"
        note(f"unsupported: {reason}")
        write_own_record(case, out, log, "unsupported", reason, started=started)
        return 0
    t0 = time.monotonic()
    alloc = hold_device(case, env, slots_dir, slots_total)
    waited = f"waited {time.monotonic() - t0:.1f} s"
    if case.device != "cuda":
        note(f"the CPU slot in {cpu_lock_dir()} ({waited} for other CPU cases to end)")
    elif alloc is not None:
        note(f"GPU slots {alloc.slots} of {slots_total} in {slots_dir} ({waited})")
    visible = env.get("CUDA_VISIBLE_DEVICES")
    procs = agents(case, harness, timeout, out, log, cores, env, nodes_via)
    cmd = procs[0][0]
    if case.nodes > 1:
        note(f"{case.nodes} nodes of {case.gpus_per_node} ranks, via {nodes_via}: "
             f"{len(procs)} process(es)")
    for agent_cmd, agent_env in procs:
        note(f"CUDA_VISIBLE_DEVICES={agent_env.get('CUDA_VISIBLE_DEVICES')!r}; running: "
             f"{shlex.join(agent_cmd)}")
    try:
        outcome = supervise_all([c for c, _ in procs], timeout=timeout + grace,
                                envs=[e for _, e in procs], stdout=note.output,
                                pass_fds=tuple(alloc.fds) if alloc else ())
    except OSError as err:  # the harness command itself cannot start
        reason = f"cannot start the harness ({shlex.join(cmd[:3])} ...): {err}"
        note(f"failed: {reason}")
        write_own_record(case, out, log, "failed", f"{reason}; see {log}", visible, started)
        return 0
    finally:
        if alloc is not None:
            alloc.release()
    rc = outcome.returncode
    if outcome.timed_out:
        reason = (f"killed after {outcome.seconds:.0f} s: over the case's timeout "
                  f"({timeout:g} s) plus {grace:g} s")
    elif rc is not None and rc < 0:
        reason = f"the harness was killed by signal {-rc} and wrote no valid record"
    else:
        reason = f"the harness exited with code {rc} and wrote no valid record"
    if _valid_record(out):
        note(f"done: record at {out} (harness exit code {rc})")
        return 0
    note(f"failed: {reason}")
    write_own_record(case, out, log, "failed", f"{reason}; see {log}", visible, started)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Run one benchmark case; always leaves a record.")
    parser.add_argument("--case", required=True,
                        help="the case with its run settings, JSON (Case.to_json)")
    parser.add_argument("--out", required=True, help="the record, JSON")
    parser.add_argument("--log", required=True, help="the case's log")
    parser.add_argument("--harness", default=DEFAULT_HARNESS,
                        help="command of the harness CLI (default: %(default)s)")
    add_slot_args(parser)
    parser.add_argument("--timeout", type=float, required=True,
                        help="seconds the harness may run the case")
    parser.add_argument("--grace", type=float, default=GRACE_S,
                        help="seconds past the case's timeout before the harness is killed")
    parser.add_argument("--cores", type=int, default=None,
                        help="CPU cores the case's ranks on one machine share (the rule "
                             "passes its rank_cores resource; default: the harness's)")
    parser.add_argument("--nodes-via", choices=NODES_VIA,
                        default=os.environ.get(NODES_VIA_ENV) or "local",
                        help="where the agents of a case on several nodes run: local (all "
                             "on this machine) or srun (one per node of this Slurm job); "
                             f"default ${NODES_VIA_ENV} or local")
    args = parser.parse_args(argv)
    for flag, path in (("--out", Path(args.out)), ("--log", Path(args.log))):
        if path.is_dir():
            parser.error(f"{flag}: {path} is a folder, not a file")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            parser.error(f"{flag}: cannot create {path.parent}: {err.strerror or err}")
    die_with_parent()  # the rule execs the runner: it ends with the Snakemake that started it
    try:
        case = Case.from_json(args.case)
    except (CaseError, ValueError) as err:
        parser.error(f"--case: {err}")
    return run(case, args.timeout, args.out, args.log, args.harness, args.slots_dir,
               args.slots_total, args.grace, args.cores, args.nodes_via)


def add_slot_args(parser) -> None:
    """``--slots-dir`` / ``--slots-total``, defaulting to the environment the workflow sets
    (``export_slots`` of the workflow's planner)."""
    total = os.environ.get(SLOTS_TOTAL_ENV)
    parser.add_argument("--slots-dir", default=os.environ.get(SLOTS_DIR_ENV),
                        help="GPU slot lock folder (CUDA only; default $SLAPO_GPU_SLOTS_DIR)")
    parser.add_argument("--slots-total", type=int, default=int(total) if total else None,
                        help="GPUs on this machine (default $SLAPO_GPU_SLOTS_TOTAL)")


if __name__ == "__main__":
    sys.exit(main())
