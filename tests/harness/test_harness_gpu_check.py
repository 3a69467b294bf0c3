"""The one-GPU check (slapo_ae/analysis/gpu_check.py): its verdicts on constructed records, and one
real run of a small cfg on CPU ranks (records, summary, resume, time budget)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from harness_util import REPO, env

from slapo_ae.analysis.gpu_check import judge, judge_model
from slapo_ae.record import Metrics, Record, write_record

H200 = {"device_name": "NVIDIA H200", "torch": "2.11.0"}


def rec(mode, rate=None, mfu=None, status="ok", model="bert-large-uncased"):
    metrics = Metrics(samples_per_s=rate, tflops_per_gpu=None if rate is None else rate,
                      mfu=mfu, peak_mem_bytes=[2**30])
    case = {"id": f"{mode}__{model}", "mode": mode, "model": model, "gpus": 1}
    return Record(status=status, case=case, reason="" if status == "ok" else "CUDA OOM",
                  metrics=metrics, env=H200)


def verdicts(*records):
    table = {(r.case["model"], r.case["mode"]): r for r in records}
    return {v.target: v for v in judge_model(table, "bert-large-uncased")}


def test_targets_pass_at_their_thresholds():
    v = verdicts(rec("slapo-megatron", 330, mfu=0.46), rec("hf-sdpa", 300),
                 rec("hf-compile", 280), rec("megatron", 250),
                 rec("slapo-deepspeed", 126, mfu=0.30), rec("deepspeed", 63))
    assert v["T1"].verdict == "PASS" and v["T1"].value == pytest.approx(1.1)
    assert "best baseline hf-sdpa" in v["T1"].detail
    assert v["T2"].verdict == "PASS" and v["T2"].value == pytest.approx(2.0)
    assert v["T3"].verdict == "PASS" and v["T3"].value == 0.46
    assert "slapo-megatron" in v["T3"].detail


def test_targets_fail_below_their_thresholds():
    v = verdicts(rec("slapo-megatron", 300, mfu=0.40), rec("hf-sdpa", 250),
                 rec("hf-compile", 290), rec("slapo-deepspeed", 100, mfu=0.44),
                 rec("deepspeed", 63))
    assert v["T1"].verdict == "FAIL" and "best baseline hf-compile" in v["T1"].detail
    assert v["T2"].verdict == "FAIL"
    assert v["T3"].verdict == "FAIL" and v["T3"].value == 0.44  # the better Slapo system


def test_missing_or_failed_records_are_not_run_with_the_reason():
    v = verdicts(rec("slapo-megatron", status="oom"), rec("hf-sdpa", 250),
                 rec("slapo-deepspeed", 100))
    assert v["T1"].verdict == "NOT-RUN" and "slapo-megatron: oom (CUDA OOM)" in v["T1"].detail
    assert v["T2"].verdict == "NOT-RUN" and "deepspeed: no record" in v["T2"].detail
    assert v["T3"].verdict == "NOT-RUN"  # no MFU: the ok Slapo record has no known peak
    # An unsupported baseline (HF has no SDPA for GPT-Neo) leaves the others to compare with.
    v = verdicts(rec("slapo-megatron", 50), rec("hf-sdpa", status="unsupported"),
                 rec("hf-compile", 40))
    assert v["T1"].verdict == "PASS" and "best baseline hf-compile" in v["T1"].detail


def test_judge_writes_the_summary(tmp_path):
    for r in (rec("slapo-megatron", 330, mfu=0.5), rec("hf-sdpa", 200)):
        write_record(r, tmp_path / f"{r.id}.json")
    judge(tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["hardware"] == "NVIDIA H200 (torch 2.11.0)"
    assert [v["verdict"] for v in summary["verdicts"]] == ["PASS", "NOT-RUN", "PASS"]
    text = (tmp_path / "summary.md").read_text()
    assert "| bert-large-uncased | T1 | PASS | 1.65x | 1.1x |" in text
    assert "| bert-large-uncased | slapo-megatron | ok | 330 | 330 | 50.0% | 1.0 | - |" in text
    assert "| bert-large-uncased | hf-sdpa | ok | 200 | 200 | - | 1.0 | 271 |" in text
    judge(tmp_path)  # summary.json beside the records is not read as a record


CFG = """\
slapo-megatron  bert-tiny  1 16 0 4 0
hf-sdpa         bert-tiny  1 16 0 4 0
hf-sdpa         gpt-neo-tiny 1 16 0 4 0
"""


def gpu_check(*args):
    return subprocess.run([sys.executable, "-m", "slapo_ae.analysis.gpu_check", *map(str, args)],
                          cwd=REPO, env=env(), capture_output=True, text=True, timeout=1200)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_run_on_cpu_ranks_resumes_and_keeps_to_its_budget(tmp_path):
    cfg = tmp_path / "small.cfg"
    cfg.write_text(CFG)
    out = tmp_path / "records"
    proc = gpu_check("run", cfg, "--out", out, "--device", "cpu", "--dtype", "fp32",
                     "--steps", "3", "--warmup", "1", "--timeout", "900")
    assert "slapo-megatron__bert-tiny__g1__s16__b4__c0: ok:" in proc.stdout
    assert "hf-sdpa__gpt-neo-tiny__g1__s16__b4__c0: unsupported: transformers has no SDPA" \
        in proc.stdout
    assert sorted(p.name for p in out.glob("*.json")) == [
        "hf-sdpa__bert-tiny__g1__s16__b4__c0.json", "hf-sdpa__gpt-neo-tiny__g1__s16__b4__c0.json",
        "slapo-megatron__bert-tiny__g1__s16__b4__c0.json", "summary.json"]
    assert (out / "logs" / "slapo-megatron__bert-tiny__g1__s16__b4__c0.log").is_file()
    verdicts = {(v["model"], v["target"]): v["verdict"]
                for v in json.loads((out / "summary.json").read_text())["verdicts"]}
    assert verdicts[("bert-tiny", "T1")] in ("PASS", "FAIL")  # both ran: a real comparison
    assert verdicts[("bert-tiny", "T3")] == "NOT-RUN"  # no MFU without a known GPU peak
    # The exit status says whether a target failed (the harness itself ran fine).
    assert proc.returncode == (1 if "FAIL" in verdicts.values() else 0), proc.stderr
    # A rerun keeps the settled records (ok, unsupported) and runs the rest; a spent budget
    # starts nothing new.
    (out / "hf-sdpa__bert-tiny__g1__s16__b4__c0.json").unlink()
    proc = gpu_check("run", cfg, "--out", out, "--device", "cpu", "--dtype", "fp32",
                     "--steps", "3", "--warmup", "1", "--timeout", "900", "--budget", "0")
    assert "slapo-megatron__bert-tiny__g1__s16__b4__c0: ok already, kept" in proc.stdout
    assert "hf-sdpa__gpt-neo-tiny__g1__s16__b4__c0: unsupported already, kept" in proc.stdout
    assert "hf-sdpa__bert-tiny__g1__s16__b4__c0: not started, the budget" in proc.stdout
    assert not (out / "hf-sdpa__bert-tiny__g1__s16__b4__c0.json").exists()
    assert "1 case(s) not run" in proc.stderr


def test_script_and_wheels_are_valid_bash():
    for script in ("scripts/gpu_check.sh", "scripts/gpu_wheels.sh"):
        subprocess.run(["bash", "-n", script], cwd=REPO, check=True)
        assert os.access(REPO / script, os.X_OK)


def test_shipped_cfg_has_every_system_for_each_model_slapo_first():
    from slapo_ae.cfg import parse_cfg

    cases = parse_cfg(REPO / "configs" / "gpu_check" / "one_gpu.cfg")
    models = ["bert-large-uncased", "EleutherAI/gpt-neo-1.3B", "facebook/opt-1.3b", "llama-1.1b"]
    modes = ["slapo-megatron", "slapo-deepspeed", "hf-sdpa", "hf-compile", "megatron",
             "deepspeed", "eager"]
    assert [(c.model, c.mode) for c in cases] == [(m, mode) for m in models for mode in modes]
    assert {c.gpus for c in cases} == {1} and {c.ckpt for c in cases} <= {0.0, None}


def test_bad_input_is_refused_in_one_line_before_anything_runs(tmp_path, capsys):
    from slapo_ae.analysis import gpu_check
    from slapo_ae.case import MODES

    bad = tmp_path / "bad.cfg"
    bad.write_text("eager bert-tiny 1 64 0 4 0\nbogus bert-tiny 1 64 0 4 0\n")
    assert gpu_check.main(["run", str(bad), "--out", str(tmp_path / "out")]) == 2
    known = ", ".join(MODES)
    assert capsys.readouterr().err.strip() == f"{bad}:2: unknown mode 'bogus'; known: {known}"
    assert not (tmp_path / "out").exists()
    assert gpu_check.main(["run", str(tmp_path / "none.cfg"), "--out", str(tmp_path / "o")]) == 2
    assert gpu_check.main(["judge", str(tmp_path / "nowhere")]) == 2
    assert "no such folder" in capsys.readouterr().err
