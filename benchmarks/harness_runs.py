"""Shared pieces of the side-by-side benchmarks (``bench_pairs.py``, ``bench_fidelity.py``):
run one case through ``slapo-bench run`` by hand, read what it measured, and summarise
repeated runs. Nothing here is asserted; the benchmarks print.

A case is the tuple of a cfg line: ``(mode, model, gpus, seq_len, dec_seq_len, batch_size)``
(checkpointing off). Runs are on CPU ranks; the caller's ``OMP_NUM_THREADS`` and friends are
dropped, as a user's shell would not have them: the harness sizes every rank's threads from
``--cores`` (slapo_ae/harness/threads.py).
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from slapo_ae.harness.launch import OFFLINE_ENV  # noqa: E402
from slapo_ae.harness.threads import THREAD_ENV_VARS  # noqa: E402


def case_label(case) -> str:
    return f"{case.mode} {case.model} {case.gpus}r"


def user_env() -> dict:
    """The environment of a user's shell: offline, no thread variables, no GPUs."""
    env = {k: v for k, v in os.environ.items() if k not in THREAD_ENV_VARS}
    env.update(OFFLINE_ENV, CUDA_VISIBLE_DEVICES="")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    return env


def run_by_hand(case, out: Path, steps: int, warmup: int, cores: int | None = None,
                extra=()) -> dict:
    """``slapo-bench run`` of ``case`` (a :class:`slapo_ae.case.Case`) on CPU ranks; returns
    the record (a dict)."""
    from slapo_ae.record import read_record

    argv = case.for_run(steps, warmup, "fp32", "cpu").to_argv()
    cmd = [sys.executable, "-m", "slapo_ae.harness.cli", "run", *argv, "--out", str(out), "--quiet",
           *(["--cores", str(cores)] if cores else []), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=user_env(), capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return read_record(out).to_dict()


def rate(record: dict) -> float | None:
    """Median samples/s of a record's timed steps; None unless ok."""
    return record["metrics"]["samples_per_s"] if record["status"] == "ok" else None


def summary(rates: list[float]) -> dict:
    """Median of run medians and their range over the runs."""
    return {"median": statistics.median(rates), "min": min(rates), "max": max(rates),
            "runs": len(rates)}


def fmt(stats: dict | None) -> str:
    if not stats:
        return "-"
    return f"{stats['median']:7.1f} [{stats['min']:.1f}-{stats['max']:.1f}]"


def load() -> str:
    """The load averages, as ``uptime`` prints them."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f}"
