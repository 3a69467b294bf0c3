"""Run one benchmark case through the harness CLI and make sure one record results.

    python -m slapo.bench.workflow.run_case --spec JSON --timeout S --out REC.json \\
        --log CASE.log [--harness "python -m slapo.bench.cli"] [--slots-dir D --slots-total T]

``--spec`` is the case's job spec (:func:`slapo.bench.workflow.plan.case_spec`), ``--timeout``
its time limit in seconds. GPU slots come from ``--slots-dir``/``--slots-total`` or the
environment the workflow sets (``SLAPO_GPU_SLOTS_DIR``, ``SLAPO_GPU_SLOTS_TOTAL``). The runner

1. on CUDA, takes the case's GPUs from the slot allocator (:mod:`.gpu_slots`) and sets
   ``CUDA_VISIBLE_DEVICES``; a case needing more GPUs than the machine has is recorded as
   ``unsupported`` without running; on CPU it hides CUDA (``CUDA_VISIBLE_DEVICES=""``);
2. runs ``<harness> run --mode ... --cores C --out REC.json --log CASE.log`` with the
   offline environment, in its own process group, under a hard timeout (the case's timeout
   plus ``--grace``, default :data:`GRACE_S`); ``--cores`` (the rule's ``rank_cores``: one
   per rank on CPU) is what the harness shares among the case's ranks, whatever
   ``OMP_NUM_THREADS`` the job inherited;
3. if the harness left no valid record (it crashed, was killed, timed out), writes a
   ``failed`` record itself, with the reason and the log path: failures are data, and a
   failing case never stops the figures of the others.

If the runner itself is interrupted (SIGINT/SIGTERM/SIGHUP, e.g. Snakemake being stopped), it
stops the harness and exits without writing a record, so the case reruns next time. Records
are only ever written atomically (:func:`slapo.bench.record.write_record`).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from slapo.bench import launch
from slapo.bench.process import own_session_and_parent_death_signal, stop_tree
from slapo.bench.record import Record, RecordError, collect_env, now, read_record, write_record
from slapo.bench.workflow.gpu_slots import GpuSlots

GRACE_S = 120  # the hard timeout is the case's timeout plus this
DEFAULT_HARNESS = "python -m slapo.bench.cli"
# The harness's own environment (offline), and no DeepSpeed op builds.
OFFLINE_ENV = {**launch.OFFLINE_ENV, "DS_BUILD_OPS": "0"}


class Interrupted(Exception):
    def __init__(self, signum: int):
        super().__init__(f"interrupted by signal {signum}")
        self.signum = signum


def harness_command(harness: str, spec: dict, out: str, log: str,
                    cores: int | None = None) -> list[str]:
    """The harness CLI call for ``spec`` (``slapo-bench run`` contract); ``cores``: the CPU
    cores the case's ranks share (None: the harness's default,
    :func:`slapo.bench.threads.default_cores`)."""
    cmd = shlex.split(harness)
    if cmd and cmd[0] in ("python", "python3"):
        cmd[0] = sys.executable
    return cmd + [
        "run", "--mode", spec["mode"], "--model", spec["model"],
        "--gpus", str(spec["gpus"]), "--seq-len", str(spec["seq_len"]),
        "--dec-seq-len", str(spec["dec_seq_len"]), "--batch-size", str(spec["batch_size"]),
        "--ckpt", str(spec["ckpt"]), "--steps", str(spec["steps"]),
        "--warmup", str(spec["warmup"]), "--dtype", spec["dtype"],
        "--timeout", str(spec["timeout"]), "--case-id", spec["case_id"],
        "--device", spec["device"], *(["--cores", str(cores)] if cores else []),
        "--out", out, "--log", log,
    ]


def case_dict(spec: dict) -> dict:
    """The record's ``case`` for a record the runner writes itself."""
    ckpt = spec["ckpt"]
    try:
        ckpt = None if spec["mode"] == "megatron" and ckpt == "0" else float(ckpt)
    except ValueError:
        pass
    return {"id": spec["case_id"], "mode": spec["mode"], "model": spec["model"],
            "gpus": spec["gpus"], "seq_len": spec["seq_len"], "dec_seq_len": spec["dec_seq_len"],
            "batch_size": spec["batch_size"], "batch_expr": str(spec["batch_size"]), "ckpt": ckpt}


def _device(spec: dict, visible: str | None) -> dict:
    if spec["device"] != "cuda":
        return {"device_name": f"cpu ({platform.machine()})", "device_count": 0, "cuda": None}
    name = None
    try:
        query = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
        if visible:
            query += ["-i", visible.split(",")[0]]
        out = subprocess.run(query, capture_output=True, text=True, timeout=10)
        name = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout else None
    except (OSError, subprocess.SubprocessError, IndexError):
        pass
    return {"device_name": name or "cuda (unknown)", "device_count": spec["gpus"], "cuda": None}


def write_own_record(spec: dict, out: str, log: str, status: str, reason: str,
                     visible: str | None = None, started: str | None = None) -> None:
    record = Record(status=status, case=case_dict(spec), reason=reason,
                    env=collect_env(_device(spec, visible)), log_path=log,
                    started_at=started or now(), finished_at=now())
    record.metrics.extra["recorded_by"] = "slapo.bench.workflow.run_case"
    write_record(record, out)


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
        self.lines.append(f"[run_case {now()}] {text}")

    def flush(self) -> None:
        self.output.seek(0)
        captured = self.output.read()
        with open(self.log, "a") as handle:
            handle.write("\n# --- slapo.bench.workflow.run_case ---\n")
            handle.write("\n".join(self.lines) + "\n")
            if captured.strip():
                handle.write("# --- harness stdout/stderr ---\n" + captured)
                if not captured.endswith("\n"):
                    handle.write("\n")
        self.lines = []
        self.output.close()


def run(spec: dict, out: str, log: str, harness: str = DEFAULT_HARNESS,
        slots_dir: str | None = None, slots_total: int | None = None,
        grace: float = GRACE_S, cores: int | None = None) -> int:
    """Run the case; returns 0 once a record is at ``out`` (see the module docstring)."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(log).parent.mkdir(parents=True, exist_ok=True)
    Path(out).unlink(missing_ok=True)  # only a record of this run counts
    Path(log).write_text("")
    note = _Notes(log)
    try:
        return _run(spec, out, log, harness, slots_dir, slots_total, grace, cores, note)
    finally:
        note.flush()


def harness_env() -> dict:
    """The harness's environment: this one, offline, DeepSpeed's extension cache in
    ``.cache/torch_extensions`` unless set, and this checkout first on ``PYTHONPATH``."""
    env = dict(os.environ)
    for key, value in OFFLINE_ENV.items():
        env.setdefault(key, value)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(".cache/torch_extensions").resolve()))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))
    return env


def _run(spec, out, log, harness, slots_dir, slots_total, grace, cores, note) -> int:
    started = now()
    env = harness_env()
    note(f"case {spec['case_id']}: {json.dumps(spec, sort_keys=True)}")
    alloc = None
    if spec["device"] == "cuda" and slots_total is not None and slots_dir:
        slots = GpuSlots(slots_dir, slots_total, os.environ.get("CUDA_VISIBLE_DEVICES"))
        if spec["gpus"] > slots_total:
            reason = f"needs {spec['gpus']} GPUs, this machine offers {slots_total}"
            note(f"unsupported: {reason}")
            write_own_record(spec, out, log, "unsupported", reason, started=started)
            return 0
        t0 = time.monotonic()
        alloc = slots.acquire(spec["gpus"])
        note(f"GPU slots {alloc.slots} of {slots_total} in {slots_dir} "
             f"(waited {time.monotonic() - t0:.1f} s)")
        env["CUDA_VISIBLE_DEVICES"] = alloc.visible_devices
    elif spec["device"] != "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    cmd = harness_command(harness, spec, out, log, cores)
    note(f"CUDA_VISIBLE_DEVICES={visible!r}; running: {shlex.join(cmd)}")

    def on_signal(signum, frame):
        raise Interrupted(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    proc = None
    try:
        proc = subprocess.Popen(cmd, env=env, stdout=note.output, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL,
                                preexec_fn=own_session_and_parent_death_signal(),
                                pass_fds=tuple(alloc.fds) if alloc else ())
        t0 = time.monotonic()
        try:
            rc = proc.wait(timeout=spec["timeout"] + grace)
            reason = f"the harness exited with code {rc} and wrote no valid record"
        except subprocess.TimeoutExpired:
            stop_tree(proc)
            rc = None
            reason = (f"killed after {time.monotonic() - t0:.0f} s: over the case's "
                      f"timeout ({spec['timeout']} s) plus {grace:g} s")
    except Interrupted as err:
        if proc is not None:
            stop_tree(proc)
        note(f"interrupted (signal {err.signum}); no record written, the case will rerun")
        return 128 + err.signum
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        if alloc is not None:
            alloc.release()
    if rc is not None and rc < 0:
        reason = f"the harness was killed by signal {-rc} and wrote no valid record"
    if _valid_record(out):
        note(f"done: record at {out} (harness exit code {rc})")
        return 0
    note(f"failed: {reason}")
    write_own_record(spec, out, log, "failed", f"{reason}; see {log}", visible, started)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Run one benchmark case; always leaves a record.")
    parser.add_argument("--spec", required=True, help="the case's job spec, JSON")
    parser.add_argument("--out", required=True, help="the record, JSON")
    parser.add_argument("--log", required=True, help="the case's log")
    parser.add_argument("--harness", default=DEFAULT_HARNESS,
                        help="command of the harness CLI (default: %(default)s)")
    add_slot_args(parser)
    parser.add_argument("--timeout", type=int, default=None,
                        help="seconds the harness may run the case (default: the spec's)")
    parser.add_argument("--grace", type=float, default=GRACE_S,
                        help="seconds past the case's timeout before the harness is killed")
    parser.add_argument("--cores", type=int, default=None,
                        help="CPU cores the case's ranks share (the rule passes its "
                             "rank_cores resource; default: the harness's)")
    args = parser.parse_args(argv)
    spec = json.loads(args.spec)
    if args.timeout is not None:
        spec["timeout"] = args.timeout
    if "timeout" not in spec:
        parser.error("no timeout: give --timeout or put it in the spec")
    return run(spec, args.out, args.log, args.harness, args.slots_dir, args.slots_total,
               args.grace, args.cores)


def add_slot_args(parser) -> None:
    """``--slots-dir`` / ``--slots-total``, defaulting to the environment the workflow sets
    (:func:`slapo.bench.workflow.plan.export_slots`)."""
    total = os.environ.get("SLAPO_GPU_SLOTS_TOTAL")
    parser.add_argument("--slots-dir", default=os.environ.get("SLAPO_GPU_SLOTS_DIR"),
                        help="GPU slot lock folder (CUDA only; default $SLAPO_GPU_SLOTS_DIR)")
    parser.add_argument("--slots-total", type=int, default=int(total) if total else None,
                        help="GPUs on this machine (default $SLAPO_GPU_SLOTS_TOTAL)")


if __name__ == "__main__":
    sys.exit(main())
