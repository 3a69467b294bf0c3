"""The one-GPU check (slapo_ae/analysis/gpu_check.py): its verdicts on constructed records, and one
real run of a small cfg on CPU ranks (records, summary, resume, time budget)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from harness_util import REPO, env

from slapo_ae.analysis.gpu_check import judge, judge_model
from slapo_ae.record import Metrics, Record, write_record

H200 = {"device_name": "NVIDIA H200", "torch": "2.11.0", "cudnn": 91501}


LOSSES = [10.5, 10.45, 10.4]


def rec(mode, rate=None, mfu=None, status="ok", model="bert-large-uncased", peak=2**30,
        loss=LOSSES):
    metrics = Metrics(samples_per_s=rate, tflops_per_gpu=None if rate is None else rate,
                      mfu=mfu, peak_mem_bytes=[peak], loss=list(loss))
    case = {"id": f"{mode}__{model}", "mode": mode, "model": model, "gpus": 1}
    return Record(status=status, case=case, reason="" if status == "ok" else "CUDA OOM",
                  metrics=metrics, env=H200)


def test_cudnn_versions_read_as_cudnn_writes_them():
    from slapo_ae.analysis.gpu_check import cudnn_text

    assert [cudnn_text(v) for v in (91501, 91900, 90100, 8907)] == [
        "9.15.1", "9.19.0", "9.1.0", "8.9.7"]


def test_the_check_names_its_folder_by_the_gpu_model():
    # scripts/gpu_check.sh: results/reference/<model>/<part>; an H100's name ends in "HBM3"
    from slapo_ae.gpus import model_slug

    names = ["NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB",
             "Tesla V100-SXM2-32GB", "NVIDIA L40S", "NVIDIA GeForce RTX 4090", None]
    assert [model_slug(n) for n in names] == ["h200", "h100", "a100", "v100", "l40s",
                                              "nvidia-geforce-rtx-4090", "no-gpu"]


def verdicts(*records, model="bert-large-uncased"):
    table = {(r.case["model"], r.case["mode"]): r for r in records}
    return {v.target: v for v in judge_model(table, model)}


def test_t3_says_what_the_formula_charges_gpt_neos_local_layers():
    model = "EleutherAI/gpt-neo-1.3B"
    slapo = rec("slapo-megatron", 40, mfu=0.46, model=model)
    slapo.case["seq_len"] = 1024
    v = verdicts(slapo, model=model)
    assert v["T3"].verdict == "PASS"
    assert v["T3"].detail == ("best Slapo system: slapo-megatron; the FLOPs formula charges the "
                              "local layers' attention as dense: 2.7% of the model FLOPs lie "
                              "beyond their window, which the MFU counts as work done")
    llama = rec("slapo-megatron", 40, mfu=0.46, model="llama-1.1b")
    llama.case["seq_len"] = 1024
    assert verdicts(llama, model="llama-1.1b")["T3"].detail == "best Slapo system: slapo-megatron"


def test_targets_pass_at_their_thresholds():
    v = verdicts(rec("slapo-megatron", 330, mfu=0.46), rec("hf-sdpa", 300),
                 rec("hf-compile", 280), rec("hf-liger", status="unsupported"),
                 rec("megatron", 250), rec("slapo-deepspeed", 63, mfu=0.30),
                 rec("deepspeed", 63))
    assert v["T1"].verdict == "PASS" and v["T1"].value == pytest.approx(1.1)
    assert "best baseline hf-sdpa" in v["T1"].detail
    assert v["T2"].verdict == "PASS" and v["T2"].value == pytest.approx(1.0)
    assert "1.00x, at most 1.00x" in v["T2"].detail
    assert "HF's eager attention" in v["T2"].detail  # what the baseline runs
    assert v["T3"].verdict == "PASS" and v["T3"].value == 0.46
    assert "slapo-megatron" in v["T3"].detail
    assert v["L"].verdict == "PASS" and v["L"].value == 0.0
    assert "against hf-sdpa" in v["L"].detail


def test_targets_fail_below_their_thresholds():
    v = verdicts(rec("slapo-megatron", 300, mfu=0.38), rec("hf-sdpa", 250),
                 rec("hf-compile", 290), rec("hf-liger", 295), rec("megatron", 120),
                 rec("slapo-deepspeed", 60, mfu=0.39), rec("deepspeed", 63))
    assert v["T1"].verdict == "FAIL" and "best baseline hf-liger" in v["T1"].detail
    assert v["T2"].verdict == "FAIL"
    assert v["T3"].verdict == "FAIL" and v["T3"].value == 0.39  # the better Slapo system


def test_speedups_state_the_range_the_steps_spread_allows():
    """One run each: T1 and T2 say what the timed steps' interquartile ranges give, so that a
    PASS by a thin margin reads as one."""
    slapo, best = rec("slapo-megatron", 330), rec("hf-compile", 300)
    slapo.metrics.spread = {"q1": 320.0, "q3": 336.0}
    best.metrics.spread = {"q1": 296.0, "q3": 305.0}
    v = verdicts(slapo, rec("hf-sdpa", 250), best, rec("hf-liger", status="unsupported"),
                 rec("megatron", 120), rec("slapo-deepspeed", 63), rec("deepspeed", 63))
    assert v["T1"].detail.endswith("; over the steps' interquartile ranges 1.05x to 1.14x")
    assert "interquartile" not in v["T2"].detail  # no spread recorded


def test_zero3_must_not_take_more_memory_and_decoders_need_45_percent():
    v = verdicts(rec("slapo-deepspeed", 70, peak=2**30 + 1), rec("deepspeed", 63))
    assert v["T2"].verdict == "FAIL" and "(1.00x, at most 1.00x)" in v["T2"].detail
    # 44% of peak: enough for BERT (40%), not for a decoder (45%)
    assert verdicts(rec("slapo-megatron", 1, mfu=0.44))["T3"].verdict == "PASS"
    llama = verdicts(rec("slapo-megatron", 1, mfu=0.44, model="llama-1.1b"), model="llama-1.1b")
    assert llama["T3"].verdict == "FAIL" and llama["T3"].threshold == 0.45


def test_losses_must_follow_the_reference_at_every_step():
    off = [10.5, 10.45, 10.4 * 1.011]  # the last step 1.1% above the reference
    v = verdicts(rec("slapo-megatron", 1, loss=off), rec("hf-sdpa", 1),
                 rec("slapo-deepspeed", 1, loss=[x * 1.009 for x in LOSSES]), rec("deepspeed", 1))
    assert v["L"].verdict == "FAIL" and v["L"].value == pytest.approx(0.011)
    assert "slapo-deepspeed" in v["L"].detail and "0.90% off" in v["L"].detail
    # Where HF has no SDPA (GPT-Neo) the next reference is taken; with none, NOT-RUN.
    v = verdicts(rec("slapo-megatron", 1), rec("hf-sdpa", status="unsupported"),
                 rec("hf-compile", 1, loss=[x * 1.005 for x in LOSSES]))
    assert v["L"].verdict == "PASS" and "against hf-compile" in v["L"].detail
    v = verdicts(rec("slapo-megatron", 1), rec("hf-sdpa", status="oom"))
    assert v["L"].verdict == "NOT-RUN" and "hf-sdpa: oom" in v["L"].detail
    v = verdicts(rec("slapo-megatron", 1, loss=LOSSES[:2]), rec("hf-sdpa", 1))
    assert v["L"].verdict == "NOT-RUN" and "logged 2 losses, hf-sdpa 3" in v["L"].detail


def test_zero3_losses_are_judged_against_deepspeed_which_starts_from_the_same_weights():
    """On a GPU the ZeRO-3 systems draw their weights on CPU, the others on the GPU: the same
    seed is the same model only within each group (as the 2026-12-04 H200 records show)."""
    far = [x * 1.05 for x in LOSSES]  # another model's losses: 5% away from hf-sdpa's
    v = verdicts(rec("slapo-megatron", 1), rec("hf-sdpa", 1), rec("slapo-deepspeed", 1, loss=far),
                 rec("deepspeed", 1, loss=far))
    assert v["L"].verdict == "PASS" and v["L"].value == 0.0
    assert "slapo-deepspeed" in v["L"].detail and "against deepspeed" in v["L"].detail
    # no deepspeed record: Slapo-ZeRO3 is not judged against hf-sdpa, and L cannot pass
    v = verdicts(rec("slapo-megatron", 1), rec("hf-sdpa", 1), rec("slapo-deepspeed", 1))
    assert v["L"].verdict == "NOT-RUN" and v["L"].value == 0.0
    assert "slapo-deepspeed not judged: no ok reference: deepspeed: no record" in v["L"].detail
    # a failing system still fails the target when the other could not be judged
    v = verdicts(rec("slapo-megatron", 1, loss=far), rec("hf-sdpa", 1), rec("slapo-deepspeed", 1))
    assert v["L"].verdict == "FAIL"


def test_missing_or_timed_out_records_are_not_run_with_the_reason():
    timed_out = rec("slapo-megatron", status="failed")
    timed_out.reason = "timeout: killed after 52 s (a hung collective, or a run slower ...)"
    timed_out.metrics.extra["timed_out"] = True
    v = verdicts(timed_out, rec("hf-sdpa", 250), rec("slapo-deepspeed", 100))
    # the deadline cuts a case's timeout: a timeout says nothing of the system
    assert v["T1"].verdict == "NOT-RUN" and "slapo-megatron: failed (timeout:" in v["T1"].detail
    assert v["T2"].verdict == "NOT-RUN" and "deepspeed: no record" in v["T2"].detail
    assert v["T3"].verdict == "NOT-RUN"  # no MFU: the ok Slapo record has no known peak
    # An unsupported baseline (HF has no SDPA for GPT-Neo) or one out of memory leaves the
    # others to compare with; one not run or failed (a timeout included) might have been the
    # best.
    v = verdicts(rec("slapo-megatron", 50), rec("hf-sdpa", status="unsupported"),
                 rec("hf-compile", 40), rec("hf-liger", status="oom"), rec("megatron", 30))
    assert v["T1"].verdict == "PASS" and "best baseline hf-compile" in v["T1"].detail
    v = verdicts(rec("slapo-megatron", 50), rec("hf-sdpa", status="unsupported"),
                 rec("hf-compile", status="failed"), rec("megatron", 30))
    assert v["T1"].verdict == "NOT-RUN"
    assert v["T1"].detail == "hf-compile: failed (CUDA OOM); hf-liger: no record"
    v = verdicts(rec("slapo-megatron", 50), *(rec(m, status="unsupported") for m in
                                            ("hf-sdpa", "hf-compile", "hf-liger", "megatron")))
    assert v["T1"].verdict == "NOT-RUN" and v["T1"].detail.count("unsupported") == 4


def test_a_slapo_system_that_could_not_train_where_its_comparison_did_fails():
    """The claims' rule (slapo_ae.analysis.claims.did_not_run): out of memory, or failed other
    than by its time limit, where what it is compared with ran, is a FAIL, not a missing
    point; and where Slapo ran and the baselines ran out of memory, Slapo passes."""
    crashed = rec("slapo-deepspeed", status="failed")
    crashed.reason = "RuntimeError: expected all tensors on the same device"
    v = verdicts(rec("slapo-megatron", status="oom"), rec("hf-sdpa", 250),
                 rec("hf-compile", status="oom"), crashed, rec("deepspeed", 60))
    assert v["T1"].verdict == "FAIL" and v["T1"].value is None
    assert v["T1"].detail == "slapo-megatron: oom (CUDA OOM) where hf-sdpa ran (250 samples/s)"
    assert v["T2"].verdict == "FAIL"
    assert v["T2"].detail.startswith("slapo-deepspeed: failed (RuntimeError: expected all")
    assert v["T3"].verdict == "FAIL" and "where deepspeed, hf-sdpa ran" in v["T3"].detail
    # Slapo trains where the baselines ran out of memory: PASS, with no ratio
    v = verdicts(rec("slapo-megatron", 40, mfu=0.5), rec("hf-sdpa", status="oom"),
                 rec("hf-compile", status="oom"), rec("hf-liger", status="unsupported"),
                 rec("megatron", status="oom"), rec("slapo-deepspeed", 20, peak=3 * 2**30),
                 rec("deepspeed", status="oom"))
    assert v["T1"].verdict == "PASS" and v["T1"].value is None
    assert v["T1"].detail.startswith("slapo-megatron 40 samples/s where no baseline trained: ")
    assert v["T2"].verdict == "PASS" and v["T2"].value is None
    assert v["T2"].detail == ("slapo-deepspeed 20 samples/s at 3.0 GiB where deepspeed: oom "
                              "(CUDA OOM)")
    # ... but not where no baseline could run for its own reasons (unsupported), or before
    # every baseline has an outcome
    unsupported = [rec(m, status="unsupported") for m in ("hf-sdpa", "hf-compile", "hf-liger")]
    assert verdicts(rec("slapo-megatron", 40), *unsupported)["T1"].verdict == "NOT-RUN"
    assert verdicts(rec("slapo-megatron", 40), rec("hf-sdpa", status="oom"),
                    *unsupported[1:])["T1"].verdict == "NOT-RUN"  # megatron: no record
    # both Slapo systems broke and nothing else ran: nothing shows the shape fits the GPU
    assert verdicts(rec("slapo-megatron", status="oom"),
                    rec("slapo-deepspeed", status="oom"))["T3"].verdict == "NOT-RUN"


def test_a_timeout_is_told_by_the_flag_the_harness_sets(tmp_path):
    """What the harness records when it kills a case at its timeout is not a broken system."""
    from slapo_ae.analysis.gpu_check import _broke
    from slapo_ae.case import Case
    from slapo_ae.harness import launch
    from slapo_ae.harness.runspec import RunSpec

    case = Case(mode="slapo-megatron", model="bert-tiny", gpus=1, seq_len=16, dec_seq_len=0,
                batch_size=4, batch_expr="4", ckpt=0.0, steps=3, warmup=1)
    spec = RunSpec(case=case, out=str(tmp_path / "r.json"), timeout=52)
    timed_out = launch.conclude(spec, None, True, tmp_path)
    assert timed_out.status == "failed" and timed_out.reason.startswith("timeout: killed")
    assert not _broke(timed_out)
    assert _broke(launch.conclude(spec, 1, False, tmp_path))  # exited 1, no record


def test_judge_writes_the_summary(tmp_path):
    slapo = rec("slapo-megatron", 330, mfu=0.5)
    slapo.metrics.extra.update(precision="bf16 autocast over fp32 parameters (the master weights)",
                               optimizer="torch.optim.adamw.AdamW (fused)",
                               notes=["Slapo kernels on cuda: layers: one region each"],
                               # rank 0's waits at the steps' closing syncs: 4 and 6 ms timed
                               sync_wait_s=[[0.5, 0.004, 0.006]])
    slapo.metrics.step_times, slapo.metrics.warmup_steps = [0.9, 0.096, 0.098], 1
    for r in (slapo, rec("hf-sdpa", 200), rec("hf-compile", 190),
              rec("hf-liger", status="unsupported"), rec("megatron", 100)):
        write_record(r, tmp_path / f"{r.id}.json")
    judge(tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["hardware"] == "NVIDIA H200 (torch 2.11.0, cuDNN 9.15.1)"
    assert [v["verdict"] for v in summary["verdicts"]] == ["PASS", "NOT-RUN", "PASS", "PASS"]
    text = (tmp_path / "summary.md").read_text()
    assert "| bert-large-uncased | T1 | PASS | 1.65x | 1.1x |" in text
    assert "| bert-large-uncased | L | PASS | 0.0% | 1% |" in text
    assert ("| bert-large-uncased | slapo-megatron | ok | 330 | 330 | 50.0% | 1.0 | 97.0 | 5.0 "
            "| - |") in text
    # a record without step times or waits (CPU ranks have no waits)
    assert "| bert-large-uncased | hf-sdpa | ok | 200 | 200 | - | 1.0 | - | - | 271 |" in text
    # what each system ran, from its record
    assert ("- bert-large-uncased, slapo-megatron: precision: bf16 autocast over fp32 "
            "parameters (the master weights); optimizer: torch.optim.adamw.AdamW (fused); "
            "Slapo kernels on cuda: layers: one region each") in text
    assert "- bert-large-uncased, hf-liger: unsupported: CUDA OOM" in text
    judge(tmp_path)  # summary.json beside the records is not read as a record
    assert "Where the GPU time goes" not in text  # nothing profiled


def test_the_exit_status_tells_a_failed_case_from_a_clean_part(tmp_path, capsys):
    """1 where a target failed or a case failed: cases that all broke (a missing import on the
    GPU machine, say) leave NOT-RUN verdicts only, which exited 0."""
    from slapo_ae.analysis.gpu_check import main

    for r in (rec("hf-sdpa", status="failed"), rec("hf-liger", status="unsupported")):
        write_record(r, tmp_path / f"{r.id}.json")
    assert main(["judge", str(tmp_path)]) == 1
    assert "1 case(s) failed: hf-sdpa__bert-large-uncased" in capsys.readouterr().err
    (tmp_path / "hf-sdpa__bert-large-uncased.json").unlink()
    assert main(["judge", str(tmp_path)]) == 0


def test_the_summary_sets_the_profiled_systems_side_by_side(tmp_path):
    """Each profiled record's rank-0 ops.json (profiles/<case id>/) gives its column: wall and
    kernel milliseconds per step, the kernels' time and calls by kind, the timed step (the
    record's median, warm-up left out) less the kernels against the commands issued, then each
    system's largest operators by kernel time."""
    slapo, compiled = rec("slapo-megatron", 330), rec("hf-compile", 300)
    # the timed steps' medians: 140 ms (the 900 ms warm-up left out) and 130 ms
    slapo.metrics.step_times, slapo.metrics.warmup_steps = [0.9, 0.13, 0.14, 0.15], 1
    slapo.metrics.extra["sync_wait_s"] = [[0.8, 0.03, 0.02, 0.04]]  # unprofiled: 30 ms timed
    compiled.metrics.step_times, compiled.metrics.warmup_steps = [0.13, 0.13], 0
    profiles = [(slapo, {"aten::mm": 180e3, "aten::_cudnn_attention_backward": 30e3,
                         "aten::_fused_adamw_": 6e3, "aten::copy_": 40e3, "aten::add_": 2e3},
                 {"cuLaunchKernel": 600, "cudaLaunchKernel": 200, "cudaMemsetAsync": 200},
                 20e3),  # its CPU waited 20 ms at the syncs: 10 a step
                (compiled, {"aten::mm": 170e3, "aten::addmm": 20e3,
                            "triton_red_fused_add_native_layer_norm_0": 30e3,
                            "triton_poi_fused__to_copy_t_3": 4e3,  # a cast (of a weight)
                            "triton_poi_fused__to_copy_add_7": 2e3}, {}, 0.0)]  # not only a cast
    for record, ops, calls, waited_us in profiles:
        write_record(record, tmp_path / f"{record.id}.json")
        folder = tmp_path / "profiles" / record.id
        folder.mkdir(parents=True)
        (folder / "rank0.ops.json").write_text(json.dumps({
            "steps": 2, "wall_us": 500e3, "device_us": sum(ops.values()) + 10e3,
            "ops": {**{name: {"calls": 8, "self_cpu_us": 1.0, "self_device_us": us}
                       for name, us in ops.items()},
                    **{name: {"calls": n, "self_cpu_us": 1.0, "self_device_us": 0}
                       for name, n in calls.items()},
                    "cudaDeviceSynchronize": {"calls": 3, "self_cpu_us": waited_us,
                                              "self_device_us": 0}},
            # slapo-megatron's operators by input shapes: two copies that ran kernels, one that
            # ran none (left out), a product (not a copy)
            "by_shape": [
                {"op": "aten::copy_", "input_shapes": [[8, 1024, 2048], [8, 1024, 2048], []],
                 "calls": 48, "self_cpu_us": 1.0, "self_device_us": 30e3},
                {"op": "aten::copy_", "input_shapes": [[4096], [4096], []], "calls": 2,
                 "self_cpu_us": 1.0, "self_device_us": 10e3},
                {"op": "aten::copy_", "input_shapes": [[2], [2], []], "calls": 2,
                 "self_cpu_us": 1.0, "self_device_us": 0.0},
                {"op": "aten::mm", "input_shapes": [[8, 8], [8, 8]], "calls": 8,
                 "self_cpu_us": 1.0, "self_device_us": 180e3}]
            if "aten::copy_" in ops else []}))
    cpu_profiled = rec("hf-sdpa", 200)  # a CPU profile has no kernel times: no column
    write_record(cpu_profiled, tmp_path / f"{cpu_profiled.id}.json")
    (tmp_path / "profiles" / cpu_profiled.id).mkdir()
    (tmp_path / "profiles" / cpu_profiled.id / "rank0.ops.json").write_text(json.dumps(
        {"steps": 2, "wall_us": 1e3, "ops": {"aten::mm": {"calls": 1, "self_cpu_us": 1.0}}}))
    judge(tmp_path)
    text = (tmp_path / "summary.md").read_text()
    section = text[text.index("## Where the GPU time goes: bert-large-uncased"):]
    assert "(hf-compile 2, slapo-megatron 2; torch.profiler)" in section
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    # slapo-megatron: 6 ms a step outside its 134 ms of kernels, over 500 commands a step;
    # hf-compile's profile counted no command
    assert rows == ["| operator | hf-compile | slapo-megatron |",
                    "| (wall) | 250.0 | 250.0 |",
                    "| (timed step, median, unprofiled) | 130.0 | 140.0 |",
                    "| (all kernels) | 118.0 | 134.0 |",
                    "| (matrix products) | 95.0 | 90.0 |",
                    "| (attention) | 0.0 | 15.0 |",
                    "| (optimizer) | 0.0 | 3.0 |",
                    "| (casts) | 2.0 | 0.0 |",
                    "| (other kernels) | 21.0 | 26.0 |",
                    "| (timed step less all kernels) | 12.0 | 6.0 |",
                    "| (CPU waiting for the GPU at syncs, profiled) | 0.0 | 10.0 |",
                    "| (CPU waiting for the GPU at the step's end, median, unprofiled) | - | "
                    "30.0 |",
                    "| (matrix products, calls) | 8 | 4 |",
                    "| (attention, calls) | 0 | 4 |",
                    "| (optimizer, calls) | 0 | 4 |",
                    "| (casts, calls) | 4 | 0 |",
                    "| (kernel launches, count) | 0 | 400 |",
                    "| (memsets, count) | 0 | 100 |",
                    "| (copies, count) | 0 | 0 |",
                    "| (microseconds outside kernels per command) | - | 12.00 |",
                    "| `aten::mm` | 85.00 | 90.00 |",
                    "| `triton_red_fused_add_native_layer_norm_0` | 15.00 | - |",
                    "| `aten::addmm` | 10.00 | - |",
                    "| `triton_poi_fused__to_copy_t_3` | 2.00 | - |",
                    "| `triton_poi_fused__to_copy_add_7` | 1.00 | - |",
                    "| `aten::copy_` | - | 20.00 |",
                    "| `aten::_cudnn_attention_backward` | - | 15.00 |",
                    "| `aten::_fused_adamw_` | - | 3.00 |",
                    "| `aten::add_` | - | 1.00 |"]
    # the copies by shape, per step; hf-compile's profile has none
    copies = section[section.index("Eager copies (`aten::copy_`)"):].splitlines()
    assert copies[2:] == ["- slapo-megatron: [8, 1024, 2048] <- [8, 1024, 2048]: 24 calls, "
                          "15.00 ms; [4096] <- [4096]: 1 calls, 5.00 ms"]


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
def test_run_on_cpu_ranks_resumes_and_keeps_to_its_deadline(tmp_path):
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
    judged = {(v["model"], v["target"]): v
              for v in json.loads((out / "summary.json").read_text())["verdicts"]}
    verdicts = {key: v["verdict"] for key, v in judged.items()}
    # T1 waits for every baseline: the cfg has one of four
    assert verdicts[("bert-tiny", "T1")] == "NOT-RUN"
    assert judged[("bert-tiny", "T1")]["detail"] == ("hf-compile: no record; hf-liger: no "
                                                     "record; megatron: no record")
    assert verdicts[("bert-tiny", "T3")] == "NOT-RUN"  # no MFU without a known GPU peak
    assert verdicts[("bert-tiny", "L")] in ("PASS", "FAIL")  # both ran: a real comparison
    # The exit status says whether a target failed (the harness itself ran fine).
    assert proc.returncode == (1 if "FAIL" in verdicts.values() else 0), proc.stderr
    # A rerun keeps the settled records (ok, unsupported) and runs the rest; a deadline too
    # near starts nothing new.
    (out / "hf-sdpa__bert-tiny__g1__s16__b4__c0.json").unlink()
    proc = gpu_check("run", cfg, "--out", out, "--device", "cpu", "--dtype", "fp32",
                     "--steps", "3", "--warmup", "1", "--timeout", "900", "--deadline", "0")
    assert "slapo-megatron__bert-tiny__g1__s16__b4__c0: ok already, kept" in proc.stdout
    assert "hf-sdpa__gpt-neo-tiny__g1__s16__b4__c0: unsupported already, kept" in proc.stdout
    assert ("hf-sdpa__bert-tiny__g1__s16__b4__c0: not started, 0 s of the 0 s deadline left "
            "(a case gets at least 45 s)") in proc.stdout
    assert not (out / "hf-sdpa__bert-tiny__g1__s16__b4__c0.json").exists()
    assert "1 case(s) not run" in proc.stderr


def test_the_deadline_cuts_each_case_timeout_and_starts_none_too_late(tmp_path, monkeypatch):
    """Each case gets min(--timeout, what is left of --deadline); none starts with less than
    --min-case seconds left (a fake clock: each case takes 70 s)."""
    from slapo_ae.analysis import gpu_check
    from slapo_ae.harness import cli

    cfg = tmp_path / "four.cfg"
    cfg.write_text("".join(f"{mode} bert-tiny 1 16 0 4 0\n" for mode in
                           ("slapo-megatron", "hf-sdpa", "hf-compile", "megatron")))
    clock, timeouts = [1000.0], []

    def fake_run(args):
        timeouts.append(args[args.index("--timeout") + 1])
        profiled.append(args[args.index("--profile") + 1:] if "--profile" in args else None)
        clock[0] += 70

    profiled = []
    monkeypatch.setattr(gpu_check.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(cli, "main", fake_run)
    skipped = gpu_check.run(cfg, tmp_path / "out", 3, 1, "fp32", "cpu", deadline_s=200,
                            timeout_s=100, min_case_s=45)
    assert timeouts == ["100", "100", "60"] and skipped == 1  # 0 s left for the fourth
    # Slapo-TP and hf-compile are profiled, after their timed steps, each into its own folder
    where = str(tmp_path / "out" / "profiles" / "slapo-megatron__bert-tiny__g1__s16__b4__c0")
    assert profiled[0] == [where, "--profile-after", str(gpu_check.PROFILE_STEPS)]
    assert profiled[1] is None and profiled[2][0].endswith("hf-compile__bert-tiny__g1__s16__b4__c0")


def test_script_and_wheels_are_valid_bash():
    for script in ("scripts/gpu_check.sh", "scripts/gpu_wheels.sh"):
        subprocess.run(["bash", "-n", script], cwd=REPO, check=True)
        assert os.access(REPO / script, os.X_OK)


def test_the_wheels_carry_every_requirement_the_device_image_lacks():
    """Each wheel scripts/gpu_wheels.sh carries needs only what is carried or what the device
    image has (scripts/gpu_image_packages.txt), for Python 3.12 on Linux, by the requirements
    of the versions pinned here. A rehearsal in a Python 3.12 environment without einops,
    msgpack, attrs and wrapt stopped at `import deepspeed` and at the Snakefile."""
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    script = (REPO / "scripts" / "gpu_wheels.sh").read_text()
    carried = set()
    for array in ("harness", "workflow"):
        names = re.search(rf"^{array}=\((.*?)\)", script, re.S | re.M).group(1)
        carried |= {canonicalize_name(n) for n in names.split()}
    image = {canonicalize_name(line) for line in
             (REPO / "scripts" / "gpu_image_packages.txt").read_text().splitlines()
             if line and not line.startswith("#")}
    assert {"torch", "triton", "numpy", "pandas"} <= image
    machine = {"python_version": "3.12", "python_full_version": "3.12.3", "os_name": "posix",
               "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
               "implementation_name": "cpython", "platform_python_implementation": "CPython",
               "extra": ""}
    missing, absent = {}, set()
    for name in sorted(carried):
        try:
            requires = distribution(name).requires or []
        except PackageNotFoundError:
            absent.add(name)
            continue
        for text in requires:
            requirement = Requirement(text)
            if requirement.marker and not requirement.marker.evaluate(machine):
                continue  # an extra's, or another platform's
            needed = canonicalize_name(requirement.name)
            if needed not in carried | image and not needed.startswith("nvidia-"):
                missing.setdefault(needed, []).append(name)
    assert not missing, f"needed on the device machine, neither carried nor in its image: {missing}"
    # only the gpu extra's liger-kernel is not in the test's environment (it needs torch and
    # triton, which the image has)
    assert absent <= {"liger-kernel"}


def _tree_copy(dest):
    """What ``scripts/gpu_check.sh`` needs of the tree, copied to ``dest``, and the environment
    to run it there with this interpreter as its ``python3``."""
    import shutil

    for path in ("Snakefile", "workflow", "configs", "slapo", "slapo_ae", "scripts"):
        if (REPO / path).is_dir():
            shutil.copytree(REPO / path, dest / path,
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(REPO / path, dest / path)
    run_env = {k: v for k, v in env().items() if k not in ("PYTHONPATH", "OUT")}
    run_env["PATH"] = f"{os.path.dirname(sys.executable)}:{run_env['PATH']}"
    return run_env


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_model_part_runs_from_the_script_and_packs_what_comes_back(tmp_path):
    """A model part through ``scripts/gpu_check.sh`` on CPU ranks (a cfg of two bert-tiny cases
    in a copy of the tree, the run options passed on): records, summary, profiles, and for the
    device tool's ``$OUT`` the tarball of the results without the traces, the traces' own
    tarball, and the summary."""
    import tarfile

    run_env = _tree_copy(tmp_path)
    (tmp_path / "configs" / "gpu_check" / "tiny.cfg").write_text(
        "slapo-megatron bert-tiny 1 16 0 2 0\nhf-sdpa bert-tiny 1 16 0 2 0\n")
    back = tmp_path / "back"
    back.mkdir()
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "tiny", "out/tiny", "--device", "cpu",
                           "--dtype", "fp32", "--steps", "3", "--warmup", "1"],
                          cwd=tmp_path, env={**run_env, "OUT": str(back)}, capture_output=True,
                          text=True, timeout=800)
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]  # 1: a FAIL
    assert "part tiny:" in proc.stdout and "no GPU" in proc.stdout
    assert sorted(p.name for p in back.iterdir()) == ["tiny-summary.md", "tiny-traces.tgz",
                                                       "tiny.tgz"]
    with tarfile.open(back / "tiny.tgz") as tar:
        names = tar.getnames()
    case = "slapo-megatron__bert-tiny__g1__s16__b2__c0"
    assert f"tiny/{case}.json" in names and "tiny/summary.md" in names
    assert f"tiny/profiles/{case}/rank0.ops.json" in names
    assert not any(name.endswith(".trace.json") for name in names)
    with tarfile.open(back / "tiny-traces.tgz") as tar:
        assert tar.getnames() == [f"tiny/profiles/{case}/rank0.trace.json"]


def test_options_without_an_out_folder_leave_the_default_folder(tmp_path):
    """``gpu_check.sh PART --deadline 0``: the first option is not taken for the folder (it
    was: ``mkdir -p --deadline`` stopped the script after its wheel installs)."""
    run_env = _tree_copy(tmp_path)
    (tmp_path / "configs" / "gpu_check" / "tiny.cfg").write_text("hf-sdpa bert-tiny 1 16 0 2 0\n")
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "tiny", "--device", "cpu",
                           "--deadline", "0"], cwd=tmp_path, env=run_env, capture_output=True,
                          text=True, timeout=300)
    assert "0 s of the 0 s deadline left" in proc.stdout, proc.stdout[-2000:] + proc.stderr
    assert (tmp_path / "results" / "reference" / "no-gpu" / "tiny" / "summary.md").is_file()
    assert not (tmp_path / "--deadline").exists()


@pytest.mark.slow
def test_the_workflow_part_runs_snakemake_with_its_targets(tmp_path):
    """Part ``workflow``, dry (``-n``, passed on to Snakemake) on a copy of the tree: both of its
    Snakemake runs plan their jobs. (The part had never run: ``--resources gpus=1`` before the
    targets took them for resources, and Snakemake stopped at once.)"""
    run_env = _tree_copy(tmp_path)
    out = tmp_path / "out"
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "workflow", str(out), "-n"],
                          cwd=tmp_path, env=run_env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = (out / "snakemake.log").read_text()
    assert log.count("This was a dry-run (flag -n)") == 2, log[-3000:]
    first = log[:log.index("This was a dry-run")]
    assert re.search(r"^case +6$", first, re.MULTILINE), first[-2000:]  # gpu-smoke's cases
    assert re.search(r"^claims +1$", log, re.MULTILINE), log[-2000:]  # the whole DAG after


def test_shipped_parts_have_every_system_of_the_targets_slapo_first():
    """One part per model, each with Slapo-TP, T1's baselines and T2's pair, in that order;
    the script knows exactly these parts and `workflow`."""
    from slapo_ae.analysis.gpu_check import SLAPO_MODES, T1_BASELINES
    from slapo_ae.cfg import parse_cfg

    parts = {"bert": "bert-large-uncased", "gpt-neo": "EleutherAI/gpt-neo-1.3B",
             "opt": "facebook/opt-1.3b", "llama": "llama-1.1b"}
    assert sorted(p.stem for p in (REPO / "configs" / "gpu_check").glob("*.cfg")) == sorted(parts)
    modes = [SLAPO_MODES[0], *T1_BASELINES, SLAPO_MODES[1], "deepspeed"]
    for part, model in parts.items():
        cases = parse_cfg(REPO / "configs" / "gpu_check" / f"{part}.cfg")
        assert [(c.model, c.mode) for c in cases] == [(model, mode) for mode in modes], part
        assert {c.gpus for c in cases} == {1} and {c.ckpt for c in cases} <= {0.0, None}
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "nonesuch"], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("scripts/gpu_check.sh: unknown part 'nonesuch'; parts: bert "
                                   "gpt-neo llama opt workflow")


def test_bad_input_is_refused_in_one_line_before_anything_runs(tmp_path, capsys):
    from slapo_ae.analysis import gpu_check
    from slapo_ae.case import MODES

    bad = tmp_path / "bad.cfg"
    bad.write_text("eager bert-tiny 1 64 0 4 0\nbogus bert-tiny 1 64 0 4 0\n")
    assert gpu_check.main(["run", str(bad), "--out", str(tmp_path / "out")]) == 2
    known = ", ".join(MODES)
    assert capsys.readouterr().err.strip() == f"{bad}:2: unknown mode 'bogus'; known: {known}"
    assert not (tmp_path / "out").exists()
    good = tmp_path / "good.cfg"
    good.write_text("eager bert-tiny 1 64 0 4 0\n")
    assert gpu_check.main(["run", str(good), "--out", str(tmp_path / "out"),
                           "--profile-modes", "hf-compile,hf-compiled"]) == 2
    assert capsys.readouterr().err.strip() == ("--profile-modes: unknown mode(s) hf-compiled; "
                                               f"known: {known}")
    assert gpu_check.main(["run", str(good), "--out", str(tmp_path / "out"),
                           "--profile-steps", "-1"]) == 2
    assert capsys.readouterr().err.strip() == "--profile-steps must be at least 0, got -1"
    assert not (tmp_path / "out").exists()
    assert gpu_check.main(["run", str(tmp_path / "none.cfg"), "--out", str(tmp_path / "o")]) == 2
    assert gpu_check.main(["judge", str(tmp_path / "nowhere")]) == 2
    assert "no such folder" in capsys.readouterr().err
