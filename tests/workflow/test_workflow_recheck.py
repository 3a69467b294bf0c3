"""Close comparisons measured again back to back (slapo_ae.analysis.recheck) and how the
claims and Slapo-beside-its-engine take them in. Hand-written rows and records (test fixtures,
never published results); the case runs are replaced by a fake ``run_again``."""
import json

import pandas as pd
import pytest

from slapo_ae.analysis import claims, gaps, recheck
from slapo_ae.record import Record


def row(mode, rate, q1, q3, model="bert-tiny", gpus=2, experiment="e2e"):
    case_id = f"{mode}__{model}__g{gpus}"
    return {"experiment": experiment, "case_id": case_id, "mode": mode, "model": model,
            "gpus": gpus, "seq_len": 128, "dec_seq_len": 0, "batch_size": 8,
            "ckpt": float("nan") if mode == "megatron" else 0.0, "status": "ok",
            "samples_per_s": rate, "samples_per_s_q1": q1, "samples_per_s_q3": q3,
            "profile": "test"}


E2E = [
    # C1 and Slapo-TP vs Megatron-LM, 2 ranks: Slapo behind by a margin of 85 / 75 = 1.13
    row("megatron", 90, 85, 95), row("slapo-megatron", 70, 65, 75),
    row("deepspeed", 40, 38, 42), row("slapo-deepspeed", 45, 43, 47),  # ahead: 43 / 42 = 1.02
    # 1 rank: Slapo-TP far ahead (48 / 21 = 2.3), not measured again
    row("megatron", 20, 19, 21, gpus=1), row("slapo-megatron", 50, 48, 52, gpus=1),
    row("deepspeed", 18, 17, 19, gpus=1), row("slapo-deepspeed", 19, 16, 22, gpus=1),
]
ABLATION = [row(m, r, r - 5, r + 5, gpus=g, experiment="ablation") for m, r, g in (
    ("eager", 100, 1), ("slapo-kernel", 80, 1),  # behind by 95 / 85 = 1.12
    ("slapo-tp-attn-ffn", 150, 2), ("slapo-tp-full", 152, 2))]  # within the noise


def frames():
    return pd.DataFrame(E2E), pd.DataFrame(ABLATION)


def test_close_calls_are_the_decided_comparisons_nearer_than_the_drift_both_ways():
    close = recheck.close_calls(recheck.comparisons(*frames()), below=1.25)
    found = [(a["case_id"], b["case_id"], verdict, round(m, 3)) for a, b, verdict, m in close]
    assert found == [
        ("slapo-deepspeed__bert-tiny__g2", "deepspeed__bert-tiny__g2", "PASS", round(43 / 42, 3)),
        ("slapo-kernel__bert-tiny__g1", "eager__bert-tiny__g1", "FAIL", round(95 / 85, 3)),
        ("slapo-megatron__bert-tiny__g2", "megatron__bert-tiny__g2", "FAIL", round(85 / 75, 3)),
    ]  # each pair once, though C1 and Slapo-TP vs Megatron-LM both make the last one
    assert recheck.close_calls(recheck.comparisons(*frames()), below=1.0) == []


def fake_runs(rates, calls):
    """A run_again that records the order of the runs and measures ``rates[mode]``."""
    def run_again(fields, out_dir, steps, warmup, device, dtype, harness, timeout=None):
        calls.append((fields["case_id"], steps, warmup, out_dir.name))
        rate = rates[fields["mode"]]
        if rate is None:
            return Record("failed", {"id": fields["case_id"]}, reason="boom")
        return Record("ok", {"id": fields["case_id"]}, metrics={
            "samples_per_s": rate, "spread": {"q1": rate - 2, "q3": rate + 2}})
    return run_again


def test_recheck_runs_each_close_pair_back_to_back_alternating_the_order(monkeypatch, tmp_path):
    calls = []
    rates = {"deepspeed": 40, "slapo-deepspeed": 47,  # ahead again
             "eager": 90, "slapo-kernel": 91,  # the gap was the drift
             "megatron": 80, "slapo-megatron": 70}
    monkeypatch.setattr(recheck, "run_again", fake_runs(rates, calls))
    result = recheck.recheck(*frames(), tmp_path, steps=24, warmup=4, most=1)
    assert [(c[0], c[3]) for c in calls] == [
        # where Slapo is behind first, past the limit (--max 1) ...
        ("eager__bert-tiny__g1", "eager__bert-tiny__g1"),  # b first ...
        ("slapo-kernel__bert-tiny__g1", "slapo-kernel__bert-tiny__g1"),  # not reproduced
        ("slapo-megatron__bert-tiny__g2", "slapo-megatron__bert-tiny__g2"),  # ... then a first
        ("megatron__bert-tiny__g2", "megatron__bert-tiny__g2"),  # the pair agrees:
        ("slapo-megatron__bert-tiny__g2", "slapo-megatron__bert-tiny__g2.repeat"),  # repeat
        ("deepspeed__bert-tiny__g2", "deepspeed__bert-tiny__g2"),  # ... then the closest
        ("slapo-deepspeed__bert-tiny__g2", "slapo-deepspeed__bert-tiny__g2"),
        ("deepspeed__bert-tiny__g2", "deepspeed__bert-tiny__g2.repeat")]
    assert {c[1:3] for c in calls} == {(24, 4)}
    assert (result["close"], result["trailing"], result["measured"]) == (3, 2, 3)
    assert result["not_measured"] == []
    again = {c["a"]: c["verdict_again"] for c in result["comparisons"].values()}
    assert again == {"slapo-deepspeed__bert-tiny__g2": "PASS",
                     "slapo-kernel__bert-tiny__g1": "INCONCLUSIVE",  # the gap was the drift
                     "slapo-megatron__bert-tiny__g2": "FAIL"}
    repeats = {c["a"]: c.get("verdict_repeat") for c in result["comparisons"].values()}
    assert repeats == {"slapo-deepspeed__bert-tiny__g2": "PASS",
                       "slapo-kernel__bert-tiny__g1": None,  # no repeat where the pair differs
                       "slapo-megatron__bert-tiny__g2": "FAIL"}
    json.dumps(result)


def test_a_verdict_the_pair_confirms_must_hold_against_the_repeat_too(monkeypatch, tmp_path):
    e2e = pd.DataFrame(E2E[:2])  # Slapo-TP behind Megatron-LM at 2 ranks
    calls = []
    runs = {"megatron": iter([80, 60]), "slapo-megatron": iter([70])}  # the repeat: 60
    monkeypatch.setattr(recheck, "run_again", lambda fields, out_dir, *a, **k: calls.append(
        out_dir.name) or Record("ok", {"id": fields["case_id"]}, metrics={
            "samples_per_s": (r := next(runs[fields["mode"]])), "spread": {"q1": r - 2,
                                                                           "q3": r + 2}}))
    result = recheck.recheck(e2e, None, tmp_path, steps=24, warmup=4)
    assert calls == ["megatron__bert-tiny__g2", "slapo-megatron__bert-tiny__g2",
                     "megatron__bert-tiny__g2.repeat"]
    [entry] = result["comparisons"].values()
    assert (entry["verdict_again"], entry["verdict_repeat"]) == ("FAIL", "PASS")
    slapo, megatron = E2E[1], E2E[0]
    verdict, note = claims.after_recheck("FAIL", slapo, megatron, result["comparisons"])
    assert verdict == "INCONCLUSIVE"
    assert note == ("; not reproduced back to back: 70 [68-72] against 80 [78-82], then "
                    "Megatron-LM again 60 [58-62]")
    entry["repeat"].update(samples_per_s=85, samples_per_s_q1=83, samples_per_s_q3=87)
    verdict, note = claims.after_recheck("FAIL", slapo, megatron, result["comparisons"])
    assert verdict == "FAIL" and note.startswith("; confirmed back to back: 70 [68-72]")
    entry["repeat"].update(status="failed")
    assert claims.after_recheck("FAIL", slapo, megatron, result["comparisons"])[0] == \
        "INCONCLUSIVE"


def test_a_close_call_where_slapo_is_not_behind_counts_against_the_limit(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(recheck, "run_again", fake_runs(
        {"eager": 90, "slapo-kernel": 91, "megatron": 80, "slapo-megatron": 70}, calls))
    result = recheck.recheck(*frames(), tmp_path, steps=24, warmup=4, most=0)
    assert len(calls) == 5 and result["measured"] == 2  # 2 pairs and the agreeing one's repeat
    assert result["not_measured"] == [
        "deepspeed__bert-tiny__g2 vs slapo-deepspeed__bert-tiny__g2"]
    again = {c["a"]: c["verdict_again"] for c in result["comparisons"].values()}
    assert again["slapo-deepspeed__bert-tiny__g2"] is None  # past the limit: not run
    json.dumps(result)


def test_slapo_behind_its_engine_is_measured_again_whatever_the_margin_and_the_limit(
        monkeypatch, tmp_path):
    far_behind = [row("deepspeed", 60, 58, 62, model="wideresnet-tiny", gpus=1),
                  row("slapo-deepspeed", 40, 38, 42, model="wideresnet-tiny", gpus=1),  # 58 / 42
                  row("megatron", 20, 19, 21, gpus=1),
                  row("slapo-megatron", 50, 48, 52, gpus=1)]  # far ahead: left alone
    e2e = pd.DataFrame(far_behind)
    assert recheck.close_calls(recheck.comparisons(e2e, None), below=1.25) == []
    calls = []
    monkeypatch.setattr(recheck, "run_again", fake_runs(
        {"deepspeed": 50, "slapo-deepspeed": 51}, calls))
    result = recheck.recheck(e2e, None, tmp_path, steps=24, warmup=4, most=0)
    assert [c[0] for c in calls] == ["deepspeed__wideresnet-tiny__g1",
                                     "slapo-deepspeed__wideresnet-tiny__g1"]
    assert (result["close"], result["trailing"], result["measured"]) == (0, 1, 1)
    [entry] = result["comparisons"].values()
    assert (entry["verdict"], round(entry["margin"], 3)) == ("FAIL", round(58 / 42, 3))
    assert entry["verdict_again"] == "INCONCLUSIVE"
    [point] = [p for p in gaps.target_points(far_behind, [], result["comparisons"])
               if p["model"] == "wideresnet-tiny"]
    assert point["verdict"] == "INCONCLUSIVE"  # not reproduced back to back: not behind
    assert point["back_to_back"].startswith("not reproduced back to back")


def test_no_close_call_starts_once_the_budget_is_spent_but_a_trailing_point_always_runs(
        monkeypatch, tmp_path):
    calls, now = [], [0.0]

    def run_again(fields, out_dir, *args, **kwargs):  # each case run takes 50 s of a fake clock
        now[0] += 50
        return fake_runs({"eager": 90, "slapo-kernel": 91, "megatron": 80,
                          "slapo-megatron": 70, "deepspeed": 40, "slapo-deepspeed": 47},
                         calls)(fields, out_dir, *args)
    monkeypatch.setattr(recheck, "run_again", run_again)
    result = recheck.recheck(*frames(), tmp_path, steps=24, warmup=4, budget_s=60,
                             clock=lambda: now[0])
    # both trailing points (2 + 3 runs) though they pass the budget; the close call not
    assert len(calls) == 5 and (result["measured"], result["seconds"]) == (2, 250)
    key = "deepspeed__bert-tiny__g2 vs slapo-deepspeed__bert-tiny__g2"
    assert result["not_measured"] == [key]
    assert result["comparisons"][key]["skipped"] == "the recheck's 60 s (--budget-s) were spent"
    verdict, note = claims.after_recheck("PASS", E2E[3], E2E[2], result["comparisons"])
    assert verdict == "PASS" and note.endswith("the recheck's 60 s (--budget-s) were spent")
    result = recheck.recheck(*frames(), tmp_path, steps=24, warmup=4, budget_s=1000,
                             clock=lambda: now[0])
    assert result["measured"] == 3 and result["not_measured"] == []


def timed(rows, seconds):
    """``rows`` with start and end times ``seconds`` apart, as the aggregate tables have them."""
    return [{**r, "started_at": "2026-12-04T21:36:44+00:00",
             "finished_at": f"2026-12-04T21:{36 + (44 + seconds) // 60}:{(44 + seconds) % 60:02d}"
                            "+00:00"} for r in rows]


def test_the_time_target_leaves_the_recheck_what_the_cases_runs_and_the_reserve_do_not_take():
    e2e, ablation = pd.DataFrame(timed(E2E, 10)), pd.DataFrame(timed(ABLATION, 5))
    assert claims.run_seconds(timed(E2E, 10)[0]) == 10.0
    assert claims.run_seconds(E2E[0]) is None  # no times: a case that did not run
    # 8 x 10 s + 4 x 5 s of case runs
    budget, basis = recheck.time_budget(e2e, ablation, 180, 300, 100)
    assert budget == 100 and basis == {"budget_s": 180, "target_s": 300, "cases_s": 100.0,
                                       "reserved_s": 100, "left_s": 100.0}
    assert recheck.time_budget(e2e, ablation, 60, 300, 100)[0] == 60  # the cap holds
    assert recheck.time_budget(e2e, ablation, None, 300, 100)[0] == 100
    assert recheck.time_budget(e2e, ablation, None, 150, 100)[0] == 0  # never below 0
    assert recheck.time_budget(e2e, ablation, 180, None)[0] == 180  # no target: the cap alone


def test_no_close_call_starts_that_its_cases_run_times_say_would_end_past_the_budget(
        monkeypatch, tmp_path):
    calls, now = [], [0.0]

    def run_again(fields, out_dir, *args, **kwargs):  # each case run takes 10 s, as its row says
        now[0] += 10
        return fake_runs({"eager": 90, "slapo-kernel": 91, "megatron": 80,
                          "slapo-megatron": 70, "deepspeed": 40, "slapo-deepspeed": 47},
                         calls)(fields, out_dir, *args)
    monkeypatch.setattr(recheck, "run_again", run_again)
    e2e, ablation = pd.DataFrame(timed(E2E, 10)), pd.DataFrame(timed(ABLATION, 10))
    # 120 s of case runs and 60 reserved leave 85 s of the 265. The trailing points take 50 s
    # (2 + 3 runs); Slapo-TP stays behind Megatron-LM, so rule gaps will profile both, 20 s
    # more; the close call would take 30 s more still, so it does not start
    result = recheck.recheck(e2e, ablation, tmp_path, steps=24, warmup=4, budget_s=180,
                             target_s=265, reserved_s=60, clock=lambda: now[0])
    assert len(calls) == 5 and result["seconds"] == 50 and result["budget_s"] == 85
    assert result["profiles_expected_s"] == 20
    key = "deepspeed__bert-tiny__g2 vs slapo-deepspeed__bert-tiny__g2"
    assert result["not_measured"] == [key]
    assert result["comparisons"][key]["skipped"] == (
        "its runs (about 30 s) would end past the recheck's 85 s (the time target's 265 s "
        "less 120 s of case runs and 60 s reserved)")
    assert result["budget"]["cases_s"] == 120.0
    calls.clear()
    result = recheck.recheck(e2e, ablation, tmp_path, steps=24, warmup=4, budget_s=180,
                             target_s=285, reserved_s=60, clock=lambda: now[0])
    assert result["measured"] == 3 and len(calls) == 8  # 105 s left: it fits
    calls.clear()
    result = recheck.recheck(e2e, ablation, tmp_path, steps=24, warmup=4, budget_s=60,
                             target_s=285, reserved_s=60, clock=lambda: now[0])
    assert result["comparisons"][key]["skipped"] == "the recheck's 60 s (--budget-s) were spent"


def test_a_close_comparison_past_the_limit_keeps_its_verdict_and_says_it_was_not_rerun(
        monkeypatch, tmp_path):
    monkeypatch.setattr(recheck, "run_again", fake_runs(
        {"megatron": 80, "slapo-megatron": 70, "eager": 90, "slapo-kernel": 91}, []))
    result = recheck.recheck(*frames(), tmp_path, steps=24, warmup=4, most=0)
    verdict, note = claims.after_recheck("PASS", E2E[3], E2E[2], result["comparisons"])
    assert verdict == "PASS"
    assert note == ("; close (margin 1.02) but not measured back to back: only the 0 closest "
                    "of 1 are measured (--max)")
    md = claims.to_markdown(claims.check_all(*frames(), None, recheck=result))
    assert "1 more close one(s), past the limit, were not and are marked so" in md


def test_a_verdict_stands_only_if_the_back_to_back_pair_agrees():
    a, b = row("slapo-megatron", 70, 65, 75), row("megatron", 90, 85, 95)
    key = claims.pair_key(a, b)

    def rechecks(rate_a, rate_b, status="ok"):
        rerun = {a["case_id"]: {**a, "samples_per_s": rate_a, "samples_per_s_q1": rate_a - 1,
                                "samples_per_s_q3": rate_a + 1, "status": status},
                 b["case_id"]: {**b, "samples_per_s": rate_b, "samples_per_s_q1": rate_b - 1,
                                "samples_per_s_q3": rate_b + 1}}
        return {key: {"rerun": rerun}}

    verdict, note = claims.after_recheck("FAIL", a, b, rechecks(60, 80))
    assert verdict == "FAIL" and note.startswith("; confirmed back to back: 60 [59-61]")
    verdict, note = claims.after_recheck("FAIL", a, b, rechecks(80, 79))
    assert verdict == "INCONCLUSIVE" and note.startswith("; not reproduced back to back")
    assert claims.after_recheck("FAIL", a, b, rechecks(60, 80, "failed"))[0] == "INCONCLUSIVE"
    assert claims.after_recheck("FAIL", a, b, None) == ("FAIL", "")  # not measured again
    assert claims.after_recheck("INCONCLUSIVE", a, b, rechecks(60, 80)) == ("INCONCLUSIVE", "")


def test_claims_and_engines_take_the_back_to_back_verdicts_in(monkeypatch, tmp_path):
    rates = {"deepspeed": 40, "slapo-deepspeed": 47, "eager": 90, "slapo-kernel": 91,
             "megatron": 80, "slapo-megatron": 70}
    monkeypatch.setattr(recheck, "run_again", fake_runs(rates, []))
    result = recheck.recheck(*frames(), tmp_path, steps=24, warmup=4)
    e2e, ablation = frames()
    profiled = []
    monkeypatch.setattr(gaps, "profile_case", lambda case, where, *a: profiled.append(
        (case["mode"], where.name)) or {"steps": 1, "wall_us": 1e4, "ops": {}})
    engines = gaps.find_gaps(E2E, ABLATION, tmp_path / "p", rechecks=result["comparisons"])
    relation = {(p["what"], p["gpus"]): p["relation"] for p in engines["points"]}
    assert relation[("+ Kernel Opt vs Vanilla", 1)] == gaps.NOT_REPRODUCED
    assert relation[("Slapo-TP vs Megatron-LM", 2)] == "behind"  # confirmed: profiled
    assert profiled == [("megatron", "baseline"), ("slapo-megatron", "slapo")]
    checked = claims.check_all(e2e, ablation, None, gaps=engines, recheck=result)
    c1, _, _, c4 = checked["claims"]
    two = next(p for p in c1["points"] if p["gpus"] == 2)
    assert two["verdict"] == "FAIL" and "confirmed back to back: 70 [68-72]" in two["why"]
    kernel = c4["points"][0]
    assert kernel["verdict"] == "INCONCLUSIVE"
    assert "not reproduced back to back: 91 [89-93] against 90 [88-92]" in kernel["why"]
    text = claims.to_markdown(checked)
    assert "**Back to back.** This machine's speed drifts" in text
    assert "A decided comparison whose margin is below 1.25x was run again" in text
    assert ("3 comparison(s) measured again here (2 with a repeat), with 24 steps "
            "(4 warm-up) each") in text


@pytest.mark.parametrize("argv", [[], ["--below", "1.1", "--max", "0"]])
def test_recheck_cli_with_no_data_writes_an_empty_result(tmp_path, argv):
    out = tmp_path / "recheck.json"
    assert recheck.main(["--out", str(out), "--runs", str(tmp_path / "r"), "--steps", "5",
                         "--warmup", "1", *argv]) == 0
    assert json.loads(out.read_text())["comparisons"] == {}


@pytest.mark.slow
def test_run_again_runs_a_rows_case_through_the_harness_holding_the_cpu_slot(tmp_path,
                                                                            monkeypatch):
    """A real rerun (eager bert-tiny, one rank, 3 steps): an ok record of that case, with the
    machine's CPU slot taken for it, as the case runner takes it for every CPU case."""
    from slapo_ae.analysis import rerun
    from slapo_ae.harness import gpu_slots

    taken = []
    real_acquire = gpu_slots.GpuSlots.acquire

    def acquire(self, count, *args, **kwargs):
        taken.append((str(self.lock_dir), count))
        return real_acquire(self, count, *args, **kwargs)

    monkeypatch.setenv("SLAPO_CPU_LOCK_DIR", str(tmp_path / "lock"))
    monkeypatch.setattr(gpu_slots.GpuSlots, "acquire", acquire)
    fields = rerun.case_fields({**row("eager", 1.0, 1.0, 1.0, gpus=1), "seq_len": 16,
                                "batch_size": 2})
    record = rerun.run_again(fields, tmp_path / "run", steps=3, warmup=1, device="cpu",
                             dtype="fp32")
    assert record is not None and record.status == "ok", (tmp_path / "run" / "run.log")
    assert record.case["id"] == "eager__bert-tiny__g1__s16__b2__c0"
    assert len(record.metrics.step_times) == 3
    assert taken == [(str(tmp_path / "lock"), 1)]


def test_a_rerun_keeps_the_rows_nodes_and_3d_layout():
    from slapo_ae.analysis.rerun import case_fields

    plain = case_fields(row("slapo-megatron", 1.0, 1.0, 1.0))
    assert "pp" not in plain and plain["nodes"] == 1
    staged = case_fields({**row("slapo-megatron", 1.0, 1.0, 1.0, gpus=4), "nodes": 2,
                          "pp": 2, "tp": 2, "dp": 1, "micro_batch": 2})
    assert (staged["nodes"], staged["pp"], staged["tp"], staged["micro_batch"]) == (2, 2, 2, 2)
    zero3 = case_fields({**row("deepspeed", 1.0, 1.0, 1.0, gpus=4), "pp": 1, "tp": 1, "dp": 4,
                         "micro_batch": 2})
    assert "pp" not in zero3  # data parallel by its mode, not 3D


def test_a_rerun_that_does_not_run_ok_leaves_the_point_undecided(monkeypatch, tmp_path):
    """On a GPU a rerun can run out of memory or time out: the recheck goes on, and the
    comparison it could not repeat is INCONCLUSIVE, with the reason."""
    calls = []
    rates = {"deepspeed": 40, "slapo-deepspeed": None,  # the rerun fails
             "eager": 90, "slapo-kernel": 91, "megatron": 80, "slapo-megatron": 70}
    monkeypatch.setattr(recheck, "run_again", fake_runs(rates, calls))
    result = recheck.recheck(*frames(), tmp_path, steps=24, warmup=4, most=3)
    entry = result["comparisons"][claims.pair_key(E2E[2], E2E[3])]
    assert entry["verdict_again"] == "INCONCLUSIVE" and "repeat" not in entry
    assert claims.compare(entry["rerun"]["slapo-deepspeed__bert-tiny__g2"],
                          entry["rerun"]["deepspeed__bert-tiny__g2"]) == "INCONCLUSIVE"
    verdict, why = claims.after_recheck("PASS", E2E[3], E2E[2], result["comparisons"])
    assert verdict == "INCONCLUSIVE"
    assert why == "; measured again back to back, which did not run ok"
