"""Helpers of the harness tests: run ``slapo-bench`` as a subprocess, as a workflow would."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY = ["--gpus", "2", "--seq-len", "16", "--batch-size", "4", "--steps", "3", "--warmup", "1"]


def env(**extra) -> dict:
    out = dict(os.environ)
    out.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                "TORCH_EXTENSIONS_DIR": str(REPO / ".cache" / "torch_extensions")})
    out.update(extra)
    return out


def slapo_bench(*args, timeout: float = 1200, **env_extra) -> subprocess.CompletedProcess:
    """``python -m slapo_ae.harness.cli ARGS`` in the repository root. Past ``timeout`` the harness
    gets SIGTERM (it then stops its ranks) before the test fails."""
    cmd = [sys.executable, "-m", "slapo_ae.harness.cli", *map(str, args)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env(**env_extra), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=60)
        finally:
            proc.kill()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_case(out: Path, *args, **env_extra):
    """``slapo-bench run ... --out OUT`` on CPU; returns (completed process, record). The exit
    status must be the one of the record's status."""
    from slapo_ae.harness.cli import EXIT_STATUS
    from slapo_ae.record import read_record

    proc = slapo_bench("run", "--device", "cpu", "--out", out, *args, **env_extra)
    assert out.is_file(), f"no record (exit status {proc.returncode}): {proc.stderr[-3000:]}"
    record = read_record(out)
    assert proc.returncode == EXIT_STATUS[record.status], (record.status, proc.stderr[-3000:])
    return proc, record
