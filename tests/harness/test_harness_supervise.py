"""The supervisor of several children at once (the agents of a case on several nodes started
on one machine): all end -> 0; one fails -> the others are stopped and its code returned; the
timeout -> all are stopped. Plain Python children, no ranks."""
import sys
import time

from slapo_ae.harness.supervise import supervise, supervise_all


def _child(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_all_children_ending_well_give_zero(tmp_path):
    marks = [tmp_path / f"{i}.done" for i in range(3)]
    cmds = [_child(f"import time, pathlib; time.sleep({0.2 * i}); "
                   f"pathlib.Path({str(m)!r}).touch()") for i, m in enumerate(marks)]
    outcome = supervise_all(cmds, timeout=60)
    assert (outcome.returncode, outcome.timed_out) == (0, False)
    assert all(m.exists() for m in marks)  # none was stopped early


def test_one_failing_child_stops_the_others():
    t0 = time.monotonic()
    outcome = supervise_all([_child("import time; time.sleep(60)"),
                             _child("import sys, time; time.sleep(0.3); sys.exit(5)")],
                            timeout=60)
    assert (outcome.returncode, outcome.timed_out) == (5, False)
    assert time.monotonic() - t0 < 30


def test_the_timeout_stops_every_child():
    t0 = time.monotonic()
    outcome = supervise_all([_child("import time; time.sleep(60)")] * 2, timeout=1)
    assert outcome.timed_out and outcome.returncode not in (0, None)
    assert time.monotonic() - t0 < 30


def test_one_child_is_supervised_as_before():
    assert supervise(_child("import sys; sys.exit(7)"), timeout=60).returncode == 7
