"""The case runner: one record per case, whatever the harness does."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from wf_util import alive

from slapo_ae.case import Case
from slapo_ae.harness import runner
from slapo_ae.record import read_record

FAKE = Path(__file__).with_name("fake_harness.py")
HARNESS = f"python {FAKE}"


CASE_ID = "slapo-megatron__bert-tiny__g2__s64__b4__c0"


def case(**overrides) -> Case:
    fields = {"mode": "slapo-megatron", "model": "bert-tiny", "gpus": 2, "seq_len": 64,
              "dec_seq_len": 0, "batch_size": 4, "batch_expr": "4", "ckpt": 0.0, "steps": 3,
              "warmup": 1, "dtype": "fp32", "device": "cpu"}
    return Case(**{**fields, **overrides})


@pytest.fixture
def fake_plan(tmp_path, monkeypatch):
    path = tmp_path / "plan.json"
    monkeypatch.setenv("FAKE_HARNESS_PLAN", str(path))
    monkeypatch.setenv("FAKE_HARNESS_TRACE", str(tmp_path / "trace.jsonl"))

    def write(plan):
        path.write_text(json.dumps(plan))

    write({})
    return write


def test_harness_command_follows_the_cli_contract():
    cmd = runner.harness_command("python -m slapo_ae.harness.cli", case(), 60, "o.json",
                                 "o.log", cores=3)
    assert cmd[0] == sys.executable and cmd[1:4] == ["-m", "slapo_ae.harness.cli", "run"]
    args = dict(zip(cmd[4::2], cmd[5::2]))
    assert args == {"--mode": "slapo-megatron", "--model": "bert-tiny", "--gpus": "2",
                    "--seq-len": "64", "--dec-seq-len": "0", "--batch-size": "4", "--ckpt": "0",
                    "--steps": "3", "--warmup": "1", "--dtype": "fp32", "--device": "cpu",
                    "--seed": "1234", "--lr": "0.0001", "--timeout": "60", "--cores": "3",
                    "--out": "o.json", "--log": "o.log"}


def test_ok_record_from_harness(tmp_path, fake_plan):
    out, log = tmp_path / "r.json", tmp_path / "logs" / "r.log"
    assert runner.run(case(), 60, str(out), str(log), HARNESS) == 0
    rec = read_record(out)
    assert rec.status == "ok" and rec.metrics.samples_per_s == 30.0
    assert "CUDA_VISIBLE_DEVICES=''" in log.read_text()  # CPU ranks: CUDA hidden


@pytest.mark.parametrize("status", ["failed", "oom", "unsupported"])
def test_the_harness_record_is_kept_whatever_its_exit_status(tmp_path, fake_plan, status):
    """The harness exits 3, 4 or 5 with a record that is not ok (cli.EXIT_STATUS): the runner
    keeps that record, the harness's own reason in it, and exits 0, so the DAG goes on."""
    fake_plan({"*": {"status": status, "reason": f"planned {status}"}})
    out, log = tmp_path / "r.json", tmp_path / "r.log"
    assert runner.run(case(), 60, str(out), str(log), HARNESS) == 0
    rec = read_record(out)
    assert (rec.status, rec.reason) == (status, f"planned {status}")
    code = {"failed": 3, "oom": 4, "unsupported": 5}[status]
    assert f"done: record at {out} (harness exit code {code})" in log.read_text()


def test_crash_becomes_failed_record(tmp_path, fake_plan):
    fake_plan({"*": {"crash": True}})
    out, log = tmp_path / "r.json", tmp_path / "r.log"
    assert runner.run(case(), 60, str(out), str(log), HARNESS) == 0
    rec = read_record(out)
    assert rec.status == "failed" and "exited with code 1" in rec.reason
    assert rec.case["id"] == CASE_ID and rec.case["gpus"] == 2
    assert rec.log_path == str(log)
    assert rec.env["device_name"].startswith("cpu")


def test_missing_harness_becomes_failed_record(tmp_path):
    out = tmp_path / "r.json"
    runner.run(case(), 60, str(out), str(tmp_path / "r.log"), "python /nonexistent/harness.py")
    assert read_record(out).status == "failed"


def test_a_harness_command_that_does_not_exist_becomes_a_failed_record(tmp_path):
    out, log = tmp_path / "r.json", tmp_path / "r.log"
    assert runner.run(case(), 60, str(out), str(log), "no-such-harness-command run") == 0
    rec = read_record(out)
    assert rec.status == "failed" and rec.case["id"] == CASE_ID
    assert rec.reason.startswith("cannot start the harness (no-such-harness-command run")
    assert "No such file or directory" in rec.reason and "cannot start" in log.read_text()


def test_a_record_or_log_path_the_runner_cannot_use_is_a_usage_error(tmp_path, capsys):
    """A folder as --out or --log, or a parent that cannot be made: exit 2 naming the flag
    (it was an IsADirectoryError or FileNotFoundError traceback), and no harness runs."""
    folder = tmp_path / "a-folder"
    folder.mkdir()
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    good = {"--out": str(tmp_path / "r.json"), "--log": str(tmp_path / "r.log")}
    for flag, bad, says in (("--out", folder, "is a folder, not a file"),
                            ("--log", folder, "is a folder, not a file"),
                            ("--out", blocker / "r.json", "cannot create")):
        paths = {**good, flag: str(bad)}
        argv = ["--case", case().to_json(), "--timeout", "60", "--harness", HARNESS,
                *[x for kv in paths.items() for x in kv]]
        with pytest.raises(SystemExit) as exit_:
            runner.main(argv)
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert f"error: {flag}: " in err and says in err, err
    assert not (tmp_path / "r.json").exists() and not list(folder.iterdir())


def test_timeout_kills_harness_and_records_failure(tmp_path, fake_plan):
    fake_plan({"*": {"sleep": 60}})
    out = tmp_path / "r.json"
    t0 = time.monotonic()
    runner.run(case(), 1, str(out), str(tmp_path / "r.log"), HARNESS, grace=1)
    assert time.monotonic() - t0 < 30
    rec = read_record(out)
    assert rec.status == "failed" and "timeout" in rec.reason


def test_cases_over_the_machine_are_unsupported(tmp_path):
    out = tmp_path / "r.json"
    runner.run(case(device="cuda", gpus=8), 60, str(out), str(tmp_path / "r.log"), HARNESS,
               slots_dir=str(tmp_path / "slots"), slots_total=4)
    rec = read_record(out)
    assert rec.status == "unsupported" and "needs 8 GPUs" in rec.reason


def test_cuda_case_gets_slots(tmp_path, fake_plan, monkeypatch):
    """Slot folder and count from the environment the workflow sets; timeout from --timeout."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("SLAPO_GPU_SLOTS_DIR", str(tmp_path / "slots"))
    monkeypatch.setenv("SLAPO_GPU_SLOTS_TOTAL", "4")
    out, log = tmp_path / "r.json", tmp_path / "r.log"
    cuda = case(device="cuda").to_json()
    assert runner.main(["--case", cuda, "--timeout", "77", "--out", str(out),
                        "--log", str(log), "--harness", HARNESS]) == 0
    assert read_record(out).env["cuda_visible_devices"] == "0,1"
    assert "--timeout 77" in log.read_text()


def test_interrupted_runner_writes_no_record(tmp_path, fake_plan):
    """SIGTERM (Snakemake stopping): the harness is stopped, no record, non-zero exit."""
    fake_plan({"*": {"sleep": 60}})
    out, log = tmp_path / "r.json", tmp_path / "r.log"
    cmd = [sys.executable, "-m", "slapo_ae.harness.runner", "--case", case().to_json(),
           "--timeout", "60", "--out", str(out), "--log", str(log), "--harness", HARNESS]
    proc = subprocess.Popen(cmd, env=dict(os.environ))
    deadline = time.monotonic() + 60
    while "fake harness" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert not out.exists()
    assert "interrupted" in log.read_text()
    assert not list(tmp_path.glob(".r.json.*"))  # nothing half-written


def _start_runner(tmp_path, name, harness=HARNESS):
    out, log = tmp_path / f"{name}.json", tmp_path / f"{name}.log"
    cmd = [sys.executable, "-m", "slapo_ae.harness.runner", "--case", case().to_json(),
           "--timeout", "60", "--out", str(out), "--log", str(log), "--harness", harness]
    proc = subprocess.Popen(cmd, env=dict(os.environ), stderr=subprocess.PIPE, text=True)
    return proc, out, log


def _wait_for(predicate, what, timeout=60):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"waited {timeout} s for {what}"
        time.sleep(0.1)


def test_two_quick_ctrl_c_stop_the_case_cleanly(tmp_path, fake_plan):
    """SIGINT twice: exit 130, no traceback, the harness gone, the runner's notes kept."""
    fake_plan({"*": {"sleep": 60}})
    proc, out, log = _start_runner(tmp_path, "r")
    _wait_for(lambda: log.exists() and "fake harness" in log.read_text(), "the harness")
    harness = int(log.read_text().split("fake harness pid ")[1].split(":")[0])
    proc.send_signal(signal.SIGINT)
    time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 130
    assert "Traceback" not in proc.stderr.read()
    assert not out.exists() and not alive(harness)
    text = log.read_text()
    assert text.count("interrupted (signal 2)") == 1 and "CUDA_VISIBLE_DEVICES=''" in text


def test_a_stop_after_the_harness_wrote_its_record_keeps_it_and_says_so(tmp_path, fake_plan):
    """Stopped while the harness shuts down after writing its record (a finished result):
    exit 128 + signal, the record kept, and the case log says so rather than "no record"."""
    fake_plan({"*": {"linger": 60}})
    proc, out, log = _start_runner(tmp_path, "r")
    _wait_for(out.exists, "the harness's record")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    assert read_record(out).status == "ok"
    text = log.read_text()
    assert "interrupted (signal 15) after the harness wrote its record" in text
    assert "no record written" not in text


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_while_waiting_for_the_cpu_slot_is_clean(tmp_path, fake_plan, monkeypatch,
                                                         signum):
    """Stopped twice while another case holds the slot allocator: exit 128 + signal, no
    traceback, no record, no harness started, the runner's notes in the case log."""
    import fcntl

    lock_dir = tmp_path / "cpu-lock"
    lock_dir.mkdir()
    monkeypatch.setenv("SLAPO_CPU_LOCK_DIR", str(lock_dir))
    guard = os.open(lock_dir / "alloc.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(guard, fcntl.LOCK_EX)  # the runner blocks taking the slot
    try:
        proc, out, log = _start_runner(tmp_path, "r")
        fds = Path(f"/proc/{proc.pid}/fd")
        _wait_for(lambda: any(str(lock_dir / "alloc.lock") == os.path.realpath(fd)
                              for fd in fds.iterdir()), "the runner to wait for the slot")
        proc.send_signal(signum)
        time.sleep(0.05)
        proc.send_signal(signum)
        assert proc.wait(timeout=60) == 128 + signum
    finally:
        os.close(guard)
    assert "Traceback" not in proc.stderr.read()
    assert not out.exists() and not (tmp_path / "trace.jsonl").exists()
    text = log.read_text()
    assert text.count(f"interrupted (signal {int(signum)})") == 1 and "case " in text


def test_cpu_cases_never_measure_side_by_side(tmp_path, fake_plan, monkeypatch):
    """The CPU slot: a second runner waits for the first case's harness to end."""
    monkeypatch.setenv("SLAPO_CPU_LOCK_DIR", str(tmp_path / "cpu-lock"))
    fake_plan({"*": {"sleep": 2}})
    first, out1, log1 = _start_runner(tmp_path, "a")
    _wait_for(lambda: log1.exists() and "fake harness" in log1.read_text(), "the first case")
    second, out2, log2 = _start_runner(tmp_path, "b")
    assert first.wait(timeout=60) == 0 and second.wait(timeout=60) == 0
    spans = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    (a, b) = sorted(spans, key=lambda s: s["start"])
    assert b["start"] >= a["end"]  # the harnesses' runs did not overlap
    assert "waited" in log2.read_text()


# -- a case on several nodes ------------------------------------------------------------
TWO_NODES = "slapo-megatron__bert-tiny__g4__n2__s64__b4__c0"


def _trace(tmp_path) -> list[dict]:
    path = tmp_path / "trace.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_case_on_two_nodes_runs_two_local_agents_and_gives_one_record(tmp_path, fake_plan):
    out, log = tmp_path / "r.json", tmp_path / "logs" / "r.log"
    assert runner.run(case(gpus=4, nodes=2), 60, str(out), str(log), HARNESS) == 0
    rec = read_record(out)
    assert rec.status == "ok" and rec.case["id"] == TWO_NODES
    assert (rec.case["nodes"], rec.case["gpus_per_node"]) == (2, 2)
    agents = _trace(tmp_path)
    assert len(agents) == 2 and len({a["pid"] for a in agents}) == 2
    endpoints = {a["rdzv_endpoint"] for a in agents}
    assert len(endpoints) == 1 and endpoints.pop().startswith("127.0.0.1:")
    assert sorted(a["log"] for a in agents) == [str(log), str(log.with_name("r.node1.log"))]
    assert "2 nodes of 2 ranks, via local: 2 process(es)" in log.read_text()


def test_a_failing_agent_stops_the_others(tmp_path, fake_plan):
    """Agent 1 crashes while agent 0 would wait (for a rank that is gone) until the timeout:
    the runner stops agent 0 at once and records the failure."""
    fake_plan({"*": {"sleep": 60}, "node1": {"sleep": 0, "crash": True}})
    out, log = tmp_path / "r.json", tmp_path / "r.log"
    t0 = time.monotonic()
    assert runner.run(case(gpus=4, nodes=2), 120, str(out), str(log), HARNESS) == 0
    assert time.monotonic() - t0 < 40
    rec = read_record(out)
    assert rec.status == "failed" and "exited with code 1" in rec.reason
    waiting = re.search(r"fake harness pid (\d+)", log.read_text())  # agent 0, before its sleep
    assert waiting and not alive(int(waiting.group(1)))


def test_local_agents_share_the_gpus_and_srun_runs_the_script():
    two = case(gpus=4, nodes=2, device="cuda")
    local = runner.agents(two, HARNESS, 60, "o.json", "l/c.log", 8,
                          {"CUDA_VISIBLE_DEVICES": "4,5,6,7"})
    assert [env["CUDA_VISIBLE_DEVICES"] for _, env in local] == ["4,5", "6,7"]
    assert [cmd[cmd.index("--log") + 1] for cmd, _ in local] == ["l/c.log", "l/c.node1.log"]
    assert all(cmd[cmd.index("--nodes") + 1] == "2" for cmd, _ in local)
    (cmd, env), = runner.agents(two, HARNESS, 60, "o.json", "c.log", 8, {}, nodes_via="srun")
    assert cmd[0] == str(runner.SRUN_CASE) and cmd[1:3] == ["--mode", "slapo-megatron"]
    assert "--nodes" not in cmd and "--rdzv-endpoint" not in cmd  # the script sets both
    assert env["SLAPO_CASE_NODES"] == "2" and int(env["SLAPO_RDZV_PORT"]) > 0
    assert env["SLAPO_HARNESS"] == f"{sys.executable} {FAKE}"
    one, = runner.agents(case(), HARNESS, 60, "o.json", "c.log", 2, {}, nodes_via="srun")
    assert one[0] == runner.harness_command(HARNESS, case(), 60, "o.json", "c.log", 2)
