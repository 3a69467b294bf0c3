"""The examples run as their docstrings say, and print what the docs promise."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEP_LINE = re.compile(r"step (\d): loss plain (\S+) scheduled (\S+); logits error (\S+); "
                       r"largest gradient error (\S+)")


def test_quickstart_trains_the_scheduled_bert_as_the_plain_one():
    # as docs/schedule-language.md runs it: torchrun, two CPU ranks over gloo
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--standalone", "examples/quickstart.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "MLP on 2 ranks: first weight (128, 64) per rank" in run.stdout
    steps = STEP_LINE.findall(run.stdout)
    assert [int(step) for step, *_ in steps] == [0, 1, 2], run.stdout
    for _, plain, scheduled, logits_error, grad_error in steps:
        assert abs(float(scheduled) - float(plain)) <= 1e-5 * abs(float(plain))
        assert float(logits_error) <= 1e-5 and float(grad_error) <= 1e-5
