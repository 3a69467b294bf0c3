"""Kick the tires: the test suite's summary plus one smoke case, then one verdict line.

    python -m slapo_ae.analysis.kick --case JSON --timeout S --out results/kick_the_tires.txt \\
        --record results/kick_the_tires/smoke.json --log results/kick_the_tires/smoke.log \\
        --test-log results/kick_the_tires/pytest.log -- PYTEST_ARGS...

1. runs ``python -m pytest PYTEST_ARGS`` (under ``--test-timeout``) and keeps its summary line;
2. runs the smoke case (``--case``, :meth:`slapo_ae.case.Case.to_json`, under ``--timeout``
   seconds) through the case runner (:mod:`slapo_ae.harness.runner`);
3. writes a short report ending in ``KICK-THE-TIRES: PASS`` or ``KICK-THE-TIRES: FAIL (why)``
   to ``--out`` and prints it. Exit code 0 on PASS, 1 on FAIL.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

from slapo_ae.atomic import write_text
from slapo_ae.case import Case
from slapo_ae.harness import runner
from slapo_ae.harness.supervise import supervise
from slapo_ae.record import RecordError, read_record


def pytest_summary(output: str) -> str | None:
    """The last summary line of pytest's output (``12 passed, 1 skipped in 3.4s``)."""
    for line in reversed(output.splitlines()):
        line = line.strip()
        if re.search(r"\b(passed|failed|error|errors|skipped|deselected|no tests ran)\b", line) \
                and re.search(r" in [\d.]+s", line):
            return line.strip("= ")
    return None


def run_tests(args: list[str], log: str, timeout: float) -> tuple[bool, str]:
    """Run pytest, its output to ``log``; (passed, summary). Supervised as the harness is
    (:func:`slapo_ae.harness.supervise.supervise`): past the timeout, or when this process is
    told to stop, pytest is stopped with the ranks and workflows its tests started."""
    cmd = [sys.executable, "-m", "pytest", *args]
    env = dict(os.environ, **{k: v for k, v in runner.OFFLINE_ENV.items()
                              if k not in os.environ})
    Path(log).parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as handle:
        handle.write(f"$ {' '.join(cmd)}\n")
        handle.flush()
        outcome = supervise(cmd, timeout=timeout, env=env, stdout=handle)
    if outcome.timed_out:
        return False, f"timed out after {timeout:.0f} s"
    rc = outcome.returncode
    summary = pytest_summary(Path(log).read_text(errors="replace")) or \
        f"no summary line (exit code {rc})"
    return rc == 0, f"{summary} [{outcome.seconds:.0f} s wall, exit code {rc}]"


def run_smoke(case: Case, timeout: float, record: str, log: str, harness: str, slots_dir,
              slots_total):
    """Run the smoke case; (ok, description)."""
    Path(record).unlink(missing_ok=True)
    t0 = time.monotonic()
    runner.run(case, timeout, record, log, harness, slots_dir, slots_total)
    took = time.monotonic() - t0
    try:
        rec = read_record(record)
    except RecordError as err:
        return False, f"no record: {err}"
    rate = rec.metrics.samples_per_s
    what = f"{case.id}: status {rec.status}"
    if rec.status == "ok":
        what += f", {rate:.3g} samples/s" if rate is not None else ", no throughput"
    else:
        what += f" ({rec.reason})"
    return rec.status == "ok", f"{what} [{took:.0f} s wall]"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", required=True, help="the smoke case, JSON (Case.to_json)")
    parser.add_argument("--timeout", type=float, required=True,
                        help="seconds the smoke case may run")
    parser.add_argument("--out", required=True)
    parser.add_argument("--record", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--test-log", required=True)
    parser.add_argument("--test-timeout", type=float, default=600)
    parser.add_argument("--harness", default=runner.DEFAULT_HARNESS)
    runner.add_slot_args(parser)
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    pytest_args = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
    Path(args.out).unlink(missing_ok=True)  # no stale verdict if this run breaks off
    t0 = time.monotonic()
    tests_ok, tests = run_tests(pytest_args, args.test_log, args.test_timeout)
    smoke_ok, smoke = run_smoke(Case.from_json(args.case), args.timeout, args.record, args.log,
                                args.harness, args.slots_dir, args.slots_total)
    problems = ([] if tests_ok else ["tests failed"]) + ([] if smoke_ok else ["smoke case not ok"])
    verdict = "KICK-THE-TIRES: PASS" if not problems else \
        f"KICK-THE-TIRES: FAIL ({'; '.join(problems)}; see {args.test_log}, {args.log})"
    text = "\n".join([
        f"tests (pytest {' '.join(pytest_args)}): {tests}",
        f"smoke case {smoke}",
        f"total {time.monotonic() - t0:.0f} s",
        verdict,
    ]) + "\n"
    write_text(args.out, text)
    print(text, end="", flush=True)
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
