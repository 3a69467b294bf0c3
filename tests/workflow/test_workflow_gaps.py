"""Slapo beside its own engine (slapo_ae.analysis.gaps): which points are behind, what a profile
comparison says, and how claims.md reports it. Hand-written rows and operator tables (test
fixtures, never published results); the real profiler is exercised in
tests/harness/test_harness_profile.py."""
import json

import pytest

from slapo_ae.analysis import claims, gaps
from slapo_ae.cfg import parse_ckpt


def row(mode, rate, q1, q3, model="bert-tiny", gpus=2, status="ok"):
    return {"mode": mode, "model": model, "gpus": gpus, "seq_len": 128, "dec_seq_len": 0,
            "batch_size": 8, "ckpt": float("nan") if mode == "megatron" else 0.0,
            "status": status, "samples_per_s": rate, "samples_per_s_q1": q1,
            "samples_per_s_q3": q3}


E2E = [row("megatron", 90, 85, 95), row("slapo-megatron", 70, 65, 75),       # behind
       row("deepspeed", 60, 55, 65), row("slapo-deepspeed", 62, 58, 66),     # within noise
       row("megatron", 40, 38, 42, gpus=1), row("slapo-megatron", 50, 48, 52, gpus=1),  # ahead
       row("deepspeed", 30, 28, 32, model="opt-tiny"),
       row("slapo-deepspeed", None, None, None, model="opt-tiny", status="oom")]
ABLATION = [row("eager", 100, 95, 105, gpus=1), row("slapo-kernel", 80, 76, 84, gpus=1),
            row("slapo-tp-attn-ffn", 120, 110, 130), row("slapo-tp-full", 125, 115, 135)]


def test_points_and_verdicts():
    points = gaps.target_points(E2E, ABLATION)
    found = {(p["what"], p["model"], p["gpus"]): p["relation"] for p in points}
    assert found == {
        ("Slapo-TP vs Megatron-LM", "bert-tiny", 1): "ahead",
        ("Slapo-TP vs Megatron-LM", "bert-tiny", 2): "behind",
        ("Slapo-ZeRO3 vs DeepSpeed ZeRO-3", "bert-tiny", 2): "within the noise",
        ("+ Kernel Opt vs Vanilla", "bert-tiny", 1): "behind",
        ("+ Attn/FFN TP vs + Kernel Opt", "bert-tiny", 2): "ahead",
        ("+ Embedding TP vs + Attn/FFN TP", "bert-tiny", 2): "within the noise",
    }  # the OOM point of opt-tiny is not a point: one side did not run
    megatron = next(p for p in points if p["relation"] == "behind" and p["gpus"] == 2)
    assert megatron["ratio"] == pytest.approx(70 / 90)
    # the CSV's checkpoint fields become valid CKPT tokens again (none for Megatron, ratio 0)
    assert parse_ckpt("megatron", megatron["baseline"]["ckpt"]) is None
    assert parse_ckpt("slapo-megatron", megatron["slapo"]["ckpt"]) == 0.0


def ops(steps, wall_ms, **per_op_ms):
    return {"steps": steps, "wall_us": wall_ms * 1e3 * steps,
            "ops": {name: {"calls": 1, "self_cpu_us": ms * 1e3 * steps}
                    for name, ms in per_op_ms.items()}}


def test_explain_puts_the_largest_difference_first():
    base = ops(5, 100, **{"aten::mm": 40, "c10d::allreduce_": 10, "aten::bernoulli_": 20})
    ours = ops(5, 130, **{"aten::mm": 41, "c10d::allreduce_": 35, "aten::uniform_": 8})
    profile = gaps.explain(base, ours)
    assert profile["wall_ms_per_step"] == pytest.approx([100, 130])
    assert profile["collective_ms_per_step"] == pytest.approx([10, 35])
    assert profile["self_ms_per_step"] == pytest.approx([70, 84]) and profile["clock"] == "cpu"
    first = profile["largest_differences"][0]
    assert (first["op"], first["baseline_ms"], first["slapo_ms"]) == ("c10d::allreduce_", 10, 35)
    text = gaps.cause_text(profile)
    assert text.startswith("profiled step (rank 0): 100.0 -> 130.0 ms wall, collectives "
                           "10.0 -> 35.0 ms")
    assert "c10d::allreduce_ 10.0 -> 35.0" in text and "aten::bernoulli_ 20.0 -> 0.0" in text
    assert "(self CPU ms/step, baseline -> Slapo)" in text


def test_on_a_gpu_operators_are_compared_by_their_kernels_time():
    # a GPU step is where its kernels run: the CPU time of launching them says little
    def gpu_ops(**per_op):
        return {"steps": 1, "wall_us": 1e5, "ops": {
            name: {"calls": 1, "self_cpu_us": cpu * 1e3, "self_device_us": device * 1e3}
            for name, (cpu, device) in per_op.items()}}

    base = gpu_ops(**{"aten::mm": (2, 50), "aten::copy_": (1, 10)})
    ours = gpu_ops(**{"aten::mm": (3, 50), "aten::copy_": (1, 30)})
    profile = gaps.explain(base, ours)
    assert profile["clock"] == "device" and profile["self_ms_per_step"] == pytest.approx([60, 80])
    assert profile["largest_differences"][0]["op"] == "aten::copy_"
    assert "(self DEVICE ms/step, baseline -> Slapo)" in gaps.cause_text(profile)
    faster = gaps.cause_text(gaps.explain(ours, base))  # the profile has Slapo ahead
    assert faster.startswith("gap not reproduced when profiled: Slapo took the shorter time")


def test_steps_of_different_batches_are_compared_per_sample():
    # + Attn/FFN TP (2 ranks, batch 16) after + Kernel Opt (1 rank, batch 8), 2026-12-02:
    # the longer step does twice the samples, so it is the faster one
    base = ops(7, 147.5, **{"aten::mm": 46})
    ours = ops(7, 241.4, **{"aten::mm": 62})
    text = gaps.cause_text(gaps.explain(base, ours, (8, 16)))
    assert text.startswith("gap not reproduced when profiled: Slapo took the shorter time a "
                           "sample")
    assert "147.5 -> 241.4 ms wall (18.4 -> 15.1 ms a sample, batches 8 and 16)" in text
    slower = gaps.cause_text(gaps.explain(base, ops(7, 320, **{"aten::mm": 62}), (8, 16)))
    assert slower.startswith("profiled step (rank 0): 147.5 -> 320.0 ms wall (18.4 -> 20.0")


def test_matrix_products_tell_more_work_from_slower_work():
    # the same work in twice the time: the rate halves (FLOPs per step from the profiler)
    base = ops(4, 100, **{"aten::mm": 40, "aten::addmm": 10, "aten::add": 5})
    ours = ops(4, 150, **{"aten::mm": 80, "aten::addmm": 20, "aten::add": 5})
    for table in (base, ours):
        table["ops"]["aten::mm"]["flops"] = 4 * 1.5e9
        table["ops"]["aten::addmm"]["flops"] = 4 * 0.5e9
        table["ops"]["aten::add"]["flops"] = 4 * 0.1e9  # element-wise: not a matrix product
    profile = gaps.explain(base, ours)
    assert profile["matmul_gflop_per_step"] == pytest.approx([2.0, 2.0])
    assert profile["matmul_ms_per_step"] == pytest.approx([50, 100])  # aten::add not counted
    assert ("matrix products 2.00 -> 2.00 GFLOP in 50.0 -> 100.0 ms (40.0 -> 20.0 GFLOP/s)"
            in gaps.cause_text(profile))
    # a step that adds ranks and doubles the batch: the work a sample, per rank, halves
    doubled = gaps.cause_text(gaps.explain(base, ours, (8, 16)))
    assert "2.00 -> 2.00 GFLOP, 250 -> 125 MFLOP a sample in" in doubled
    assert "100.0 -> 150.0 ms wall (12.5 -> 9.4 ms a sample, batches 8 and 16)" in doubled
    # profiles written before FLOPs were recorded: no matmul figures, and no error
    plain = gaps.explain(ops(4, 100, **{"aten::mm": 40}), ours)
    assert "matmul_gflop_per_step" not in plain and "matrix products" not in gaps.cause_text(plain)


def test_find_gaps_profiles_only_the_points_behind(monkeypatch, tmp_path):
    calls = []

    def fake_profile(case, out_dir, device, dtype, harness, timeout=None):
        calls.append((case["mode"], case["gpus"], out_dir.name))
        slow = case["mode"].startswith("slapo")
        return ops(2, 120 if slow else 100, **{"aten::mm": 50 + (20 if slow else 0)})

    monkeypatch.setattr(gaps, "profile_case", fake_profile)
    result = gaps.find_gaps(E2E, ABLATION, tmp_path, max_profiles=1)
    assert result["behind"] == 2
    # the largest gap first: Slapo-TP at 0.78x before Kernel Opt at 0.80x
    assert calls == [("megatron", 2, "baseline"), ("slapo-megatron", 2, "slapo")]
    behind = [p for p in result["points"] if p["relation"] == "behind"]
    profiled = next(p for p in behind if "profile" in p)
    assert "aten::mm 50.0 -> 70.0" in profiled["cause"]
    other = next(p for p in behind if "profile" not in p)
    assert other["cause"] == "not profiled (only the 1 largest gaps are)"


def test_claims_md_reports_the_engines_and_the_causes(monkeypatch, tmp_path):
    monkeypatch.setattr(gaps, "profile_case", lambda case, *a: ops(
        1, 12 if case["mode"].startswith("slapo") else 10, **{"aten::mm": 5}))
    result = claims.check_all(None, None, None, gaps=gaps.find_gaps(E2E, ABLATION, tmp_path))
    text = claims.to_markdown(result)
    assert "## The artifact's own check: Slapo beside its own engine" in text
    assert text.index("## C4") < text.index("## The artifact's own check")
    assert "| Slapo-TP vs Megatron-LM | bert-tiny | 2 | 0.7778 | behind |  | profiled step" in text
    assert "| within the noise |" in text
    json.dumps(result)


def test_gaps_cli_with_no_data_writes_an_empty_result(tmp_path):
    out = tmp_path / "gaps.json"
    assert gaps.main(["--out", str(out), "--profiles", str(tmp_path / "p")]) == 0
    assert json.loads(out.read_text())["points"] == []
