"""The cpu profile's tuning really prunes: under its memory cap per rank, its most
memory-hungry trial runs out of memory for real (recorded ``oom``) and its least hungry one
trains, so the pruning search has real OOM records to decide from."""
from __future__ import annotations

import pytest
from harness_util import REPO, run_case

from slapo_ae.tuning import load_tuning

pytestmark = pytest.mark.slow


def test_the_cpu_tunings_extreme_trials_go_oom_and_ok_under_its_cap(tmp_path):
    spec = load_tuning(REPO / "configs" / "autotune" / "cpu_tiny.yaml")
    points = spec.points()
    largest = max(points, key=lambda c: (c["batch_size"], -c["ckpt_ratio"]))
    smallest = min(points, key=lambda c: (c["batch_size"], -c["ckpt_ratio"]))
    for config, status in ((largest, "oom"), (smallest, "ok")):
        case = spec.case_for(config).for_run(spec.steps, spec.warmup, "fp32", "cpu")
        _, record = run_case(tmp_path / f"{case.id}.json", *case.to_argv())
        assert record.status == status, (config, record.reason[:2000])
        assert record.env["memory_per_rank"] == spec.memory_per_rank * 2**20
        if status == "oom":
            assert "can't allocate memory" in record.reason
