"""An interrupted run (Snakemake and its jobs killed mid-case with SIGKILL) resumes with
nothing lost and nothing half-written: after `snakemake --unlock` (a hard kill leaves the
directory lock), the next run does only the cases that had not finished."""
import json
import os
import signal
import subprocess
import time

import pytest
from wf_util import ABLATION_CASES, E2E_CASES, alive, stop_group

from slapo_ae.record import read_record

pytestmark = pytest.mark.slow

SLOW = "slapo-deepspeed__gpt-neo-tiny__g1__s64__b2__c0"


def _all_records(repo):
    return repo.records("e2e") + repo.records("ablation")


def _run_until_the_slow_case_runs(repo, records: int = 0):
    """Finish ``records`` other cases first (CPU cases take turns on the machine's CPU slot,
    so none would finish beside the slow one), then start Snakemake on the whole workflow (in
    a session of its own) with the slow case planned, and wait until its harness runs;
    (process, the case's log)."""
    if records:
        pending = [out for out in repo.dry_run()["case"] if SLOW not in out]
        repo.snakemake(*pending[:records])
    repo.plan({SLOW: {"sleep": 300}})
    log = repo.path / "results" / "e2e" / "test" / "logs" / f"{SLOW}.log"
    proc = subprocess.Popen(repo.command(), cwd=repo.path, env=repo.env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 300
    while not (log.is_file() and "fake harness pid" in log.read_text()):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_group(proc.pid)
            raise AssertionError("snakemake ended, or the slow case never started")
        time.sleep(0.2)
    return proc, log


def test_killed_run_resumes(repo):
    # the slow case runs, a few cases have finished
    proc, _ = _run_until_the_slow_case_runs(repo, records=4)
    os.killpg(proc.pid, signal.SIGKILL)  # snakemake, the runner, all in its group
    proc.wait()
    time.sleep(1)  # the harness dies with its runner (parent-death signal)

    # a job killed after its record was written but before Snakemake marked it finished is
    # still "incomplete" and reruns; every job Snakemake had finished must stay as it is
    incomplete = repo.incomplete()
    assert repo.record("e2e", SLOW) in incomplete
    done = {p: p.stat().st_mtime_ns for p in _all_records(repo) if p not in incomplete}
    assert done and not repo.record("e2e", SLOW).exists()
    for path in done:  # every record there is whole
        read_record(path)
    assert not list((repo.path / "results").rglob("*.tmp"))

    repo.plan({})
    # a hard kill leaves Snakemake's directory lock behind (a graceful stop does not)
    locked = repo.snakemake(check=False)
    assert locked.returncode != 0 and "cannot be locked" in locked.stdout + locked.stderr
    repo.snakemake("--unlock", profile=False)  # as Snakemake's lock message and the docs say
    repo.snakemake()  # the default profile has rerun-incomplete
    records = _all_records(repo)
    assert len(records) == E2E_CASES + ABLATION_CASES
    assert read_record(repo.record("e2e", SLOW)).status == "ok"
    for path, mtime in done.items():  # nothing redone that was done
        assert path.stat().st_mtime_ns == mtime, path
    ran_again = {json.loads(line)["case_id"] for line in repo.trace_file.read_text().splitlines()}
    assert SLOW in ran_again
    assert not list((repo.path / "results").rglob("*.tmp"))
    assert repo.dry_run() == {}


def test_a_case_ends_with_the_snakemake_that_started_it(repo):
    """kill -9 of Snakemake alone: its running case (runner and harness) stops within
    seconds and writes no record, so a rerun never measures beside an orphan."""
    proc, log = _run_until_the_slow_case_runs(repo)
    try:
        harness = int(log.read_text().split("fake harness pid ")[1].split(":")[0])
        os.kill(proc.pid, signal.SIGKILL)  # Snakemake only: its jobs are left to themselves
        proc.wait()
        deadline = time.monotonic() + 60
        while alive(harness):
            assert time.monotonic() < deadline, "the case outlived its Snakemake"
            time.sleep(0.2)
        # the runner appends its notes once the harness is down; it ends with them
        while "interrupted (signal 15)" not in log.read_text():
            assert time.monotonic() < deadline, f"no note of the interrupt: {log.read_text()}"
            time.sleep(0.2)
        assert not repo.record("e2e", SLOW).exists()
    finally:
        stop_group(proc.pid)
