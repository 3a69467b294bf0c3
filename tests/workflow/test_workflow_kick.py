"""kick_the_tires: test summary + smoke case, ending in one verdict line."""
import json
import time
from pathlib import Path

from slapo_ae.analysis import kick
from slapo_ae.cfg import parse_cfg_text

HERE = Path(__file__).resolve().parent
FAKE = f"python {HERE / 'fake_harness.py'}"
SMOKE = parse_cfg_text("slapo-megatron bert-tiny 2 64 0 4 0")[0].for_run(3, 1, "fp32", "cpu")
QUICK_TEST = f"{HERE / 'test_workflow_gpu_slots.py'}::test_maps_slots_to_parent_visible_devices"


def test_pytest_summary():
    out = "....\n=========== 4 passed, 1 skipped in 3.21s ===========\n"
    assert kick.pytest_summary(out) == "4 passed, 1 skipped in 3.21s"
    assert kick.pytest_summary("1 failed, 2 passed in 0.5s") == "1 failed, 2 passed in 0.5s"
    assert kick.pytest_summary("nothing here") is None


def _kick(tmp_path, *pytest_args):
    argv = ["--case", SMOKE.to_json(), "--timeout", "60", "--out", str(tmp_path / "kick.txt"),
            "--record", str(tmp_path / "smoke.json"), "--log", str(tmp_path / "smoke.log"),
            "--test-log", str(tmp_path / "pytest.log"), "--harness", FAKE, "--",
            "-q", "-p", "no:cacheprovider", *pytest_args]
    rc = kick.main(argv)
    return rc, (tmp_path / "kick.txt").read_text().splitlines()


def test_kick_passes(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_HARNESS_PLAN", str(tmp_path / "none.json"))
    (tmp_path / "none.json").write_text("{}")
    rc, lines = _kick(tmp_path, QUICK_TEST)
    assert rc == 0 and lines[-1] == "KICK-THE-TIRES: PASS"
    assert "1 passed" in lines[0] and "status ok" in lines[1]
    assert capsys.readouterr().out.rstrip().endswith("KICK-THE-TIRES: PASS")


def test_kick_fails_on_a_broken_smoke_case_or_test(tmp_path, monkeypatch):
    (tmp_path / "plan.json").write_text(json.dumps({"*": {"crash": True}}))
    monkeypatch.setenv("FAKE_HARNESS_PLAN", str(tmp_path / "plan.json"))
    rc, lines = _kick(tmp_path, QUICK_TEST, str(HERE / "no_such_test_file.py"))
    assert rc == 1
    assert lines[-1].startswith("KICK-THE-TIRES: FAIL (tests failed; smoke case not ok")


def test_tests_past_their_timeout_are_stopped_with_what_they_started(tmp_path):
    # a test that starts a process of its own and hangs: the timeout stops both
    pid_file = tmp_path / "child.pid"
    (tmp_path / "test_hang.py").write_text(
        "import subprocess, sys, time\n"
        "def test_hang():\n"
        "    child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"    open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "    time.sleep(120)\n")
    log = tmp_path / "pytest.log"
    ok, summary = kick.run_tests(["-q", "-p", "no:cacheprovider", str(tmp_path / "test_hang.py")],
                                 str(log), timeout=10)
    assert not ok and summary == "timed out after 10 s"
    assert log.read_text().startswith("$ ")
    pid = int(pid_file.read_text())
    # a signal takes effect when the process next runs: on a loaded machine that is not at
    # once (CI, load 4: the child still running right after run_tests returned)
    assert _gone_within(pid, seconds=10), f"the test's child {pid} still runs"


def _gone_within(pid: int, seconds: float) -> bool:
    """Whether process ``pid`` ends (or is a zombie, ended but not yet reaped) in time."""
    stat, deadline = Path(f"/proc/{pid}/stat"), time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except OSError:  # gone
            return True
        time.sleep(0.05)
    return False
