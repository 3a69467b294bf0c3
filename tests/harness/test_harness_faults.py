"""Failures are data: a crashing rank, a rank out of memory and a hung collective each end in
one record (``failed``/``oom``), and ``run``'s exit status says which (3, 4: cli.EXIT_STATUS).

The crash is a real one: bert-tiny's attention split over 3 tensor-parallel ranks, which
Slapo's sharding refuses in each rank (128 is not divisible by 3). A config that breaks a
rule (a hidden size the heads do not divide, the crash here before) is now refused before
the launch. The OOM and the
hang are injected on rank 1 just before set-up with ``SLAPO_BENCH_FAULT=<kind>@1:setup``
(slapo_ae/harness/worker.py), which keeps those launches short: rank 0 goes on and blocks in
DDP's first broadcast, waiting for rank 1.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from harness_util import TINY, run_case

pytestmark = pytest.mark.slow


def test_crashing_rank_gives_failed_with_traceback_and_log_tail(tmp_path):
    proc, record = run_case(tmp_path / "r.json", "--mode", "slapo-tp-full", "--model",
                            "bert-tiny", "--gpus", "3", "--seq-len", "16", "--batch-size", "3",
                            "--steps", "3", "--warmup", "1")
    assert record.status == "failed" and proc.returncode == 3
    head = record.reason.splitlines()[0]
    assert head.startswith("rank ") and "ValueError" in head and "not divisible by 3" in head
    assert "(a rank exited with code 1)" in head
    assert "traceback ---" in record.reason and "--- log tail" in record.reason
    assert record.metrics.samples_per_s is None and record.log_path.endswith("r.log")


def test_oom_on_one_rank_gives_oom(tmp_path):
    _, record = run_case(tmp_path / "r.json", "--mode", "eager", "--model", "bert-tiny", *TINY,
                         SLAPO_BENCH_FAULT="oom@1:setup")
    assert record.status == "oom"
    assert record.reason.splitlines()[0].startswith("out of memory: rank 1: OutOfMemoryError")


def test_cpu_allocator_running_out_gives_oom(tmp_path):
    """A real allocation failure on CPU (not a CUDA message) is an ``oom``, not ``failed``."""
    _, record = run_case(tmp_path / "r.json", "--mode", "eager", "--model", "bert-tiny", *TINY,
                         SLAPO_BENCH_FAULT="alloc@1:setup")
    assert record.status == "oom"
    head = record.reason.splitlines()[0]
    assert head.startswith("out of memory: rank 1: RuntimeError") and "allocate" in head


def test_a_rank_past_its_memory_cap_gives_oom_and_one_within_it_trains(tmp_path):
    """``--memory-per-rank``: a real out-of-memory on CPU (activations of a batch too large
    for 1 GiB) is recorded as ``oom``; a tiny case under the same kind of cap trains."""
    _, record = run_case(tmp_path / "big.json", "--mode", "eager", "--model", "bert-tiny",
                         "--gpus", "1", "--seq-len", "512", "--batch-size", "256", "--steps",
                         "2", "--warmup", "1", "--memory-per-rank", "1024")
    assert record.status == "oom" and "can't allocate memory" in record.reason
    assert record.env["memory_per_rank"] == 2**30
    _, record = run_case(tmp_path / "tiny.json", "--mode", "eager", "--model", "bert-tiny",
                         *TINY, "--memory-per-rank", "2048")
    assert record.status == "ok" and record.env["memory_per_rank"] == 2**31


def test_hung_collective_is_killed_after_the_timeout(tmp_path):
    proc, record = run_case(tmp_path / "r.json", "--mode", "eager", "--model", "bert-tiny",
                            *TINY, "--timeout", "40", SLAPO_BENCH_FAULT="hang@1:setup")
    assert record.status == "failed"
    assert record.reason.startswith("timeout: killed after 40 s")
    assert record.metrics.extra["timed_out"] is True
    assert ": failed: timeout" in proc.stdout
    run_id = record.metrics.extra["run_id"]  # every process of the launch is gone
    assert not [p for p in Path("/proc").glob("[0-9]*") if _cmdline_has(p, run_id)]


def _cmdline_has(proc_dir: Path, text: str) -> bool:
    try:
        return text.encode() in (proc_dir / "cmdline").read_bytes()
    except OSError:
        return False
