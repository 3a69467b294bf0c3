"""Aggregation, figures, Table 4 and the claim checks, on small hand-written records
(test fixtures, never published results)."""
import json
from pathlib import Path

import pandas as pd
import pytest
from wf_util import x_marks

from slapo_ae.analysis import aggregate, claims, plots, table4
from slapo_ae.record import Record, write_record

REPO = Path(__file__).resolve().parents[2]
CPU = {"device_name": "cpu (x86_64)", "device_count": 0, "hostname": "h"}
GPU = {"device_name": "NVIDIA H200", "device_count": 8, "hostname": "g"}


def rec(tmp_path, experiment, mode, model, gpus, rate=None, status="ok", env=CPU, batch=8,
        reason="", quartiles=None):
    """A record; ``quartiles``: (q1, q3) of its per-step samples/s (default: no spread)."""
    case = {"id": f"{mode}__{model}__g{gpus}", "mode": mode, "model": model, "gpus": gpus,
            "seq_len": 64, "dec_seq_len": 0, "batch_size": batch, "batch_expr": str(batch),
            "ckpt": 0.0}
    metrics = {"samples_per_s": rate, "peak_mem_bytes": [2**30, 2**31],
               "spread": {"min": rate, "max": rate, "iqr": 0, "stdev": 0, "steps": 4}
               if rate else None}
    if quartiles:
        metrics["spread"].update(q1=quartiles[0], q3=quartiles[1],
                                 iqr=quartiles[1] - quartiles[0])
    path = tmp_path / "results" / experiment / "p" / f"{case['id']}.json"
    write_record(Record(status=status, case=case, reason=reason, metrics=metrics,
                        env=dict(env)), path)
    return path


def e2e_records(tmp_path, env=CPU):
    rows = [("megatron", 10), ("deepspeed", 12), ("slapo-megatron", 15), ("slapo-deepspeed", 14)]
    paths = [rec(tmp_path, "e2e", m, "bert-xlarge", 2, r, env=env) for m, r in rows]
    paths += [rec(tmp_path, "e2e", "megatron", "roberta-xlarge", 2, status="unsupported",
                  env=env),
              rec(tmp_path, "e2e", "deepspeed", "roberta-xlarge", 2, 20, env=env),
              rec(tmp_path, "e2e", "slapo-megatron", "roberta-xlarge", 2, 18, env=env),
              rec(tmp_path, "e2e", "slapo-deepspeed", "roberta-xlarge", 2, status="oom",
                  env=env)]
    return paths


def ablation_records(tmp_path, rates=(5, 7, 9, 11)):
    steps = [("eager", 1), ("slapo-kernel", 1), ("slapo-tp-attn-ffn", 2), ("slapo-tp-full", 2)]
    return [rec(tmp_path, "ablation", m, "bert-xlarge", g, r, status="ok" if r else "failed")
            for (m, g), r in zip(steps, rates)]


def test_table_has_one_row_per_record(tmp_path):
    df = aggregate.table(e2e_records(tmp_path))
    assert len(df) == 8 and list(df.columns) == aggregate.COLUMNS
    row = df[df["case_id"] == "slapo-megatron__bert-xlarge__g2"].iloc[0]
    assert (row["experiment"], row["profile"], row["system"]) == ("e2e", "p", "Slapo-TP")
    assert row["model_label"] == "BERT-1B" and row["peak_mem_gib"] == 2.0
    assert row["samples_per_s"] == 15 and row["device_name"] == "cpu (x86_64)"
    oom = df[df["status"] == "oom"].iloc[0]
    assert pd.isna(oom["samples_per_s"])
    # systems in Figure 7's order within a model and GPU count
    assert list(df[df["model"] == "bert-xlarge"]["mode"]) == list(aggregate.SYSTEMS)


def test_ablation_table_speedups(tmp_path):
    df = aggregate.ablation_table(ablation_records(tmp_path))
    assert list(df["step"]) == [0, 1, 2, 3]
    assert list(df["speedup_vs_vanilla"].round(2)) == [1.0, 1.4, 1.8, 2.2]
    assert list(df["step_label"]) == ["Vanilla", "+ Kernel Opt", "+ Attn/FFN TP",
                                      "+ Embedding TP"]


def test_empty_tables_and_csv_roundtrip(tmp_path):
    for make in (aggregate.table, aggregate.ablation_table):
        df = make([])
        out = aggregate.write_csv(df, tmp_path / "t.csv")
        assert pd.read_csv(out).empty
    assert x_marks(plots.figure7(pd.read_csv(tmp_path / "t.csv"))) == 0


def test_figure7_marks_every_non_ok_bar(tmp_path):
    df = aggregate.table(e2e_records(tmp_path))
    fig = plots.figure7(df)
    assert x_marks(fig) == 2
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert titles[:2] == ["BERT-1B (bert-xlarge)", "RoBERTa-1.3B (roberta-xlarge)"]
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == ["Megatron-LM", "DeepSpeed ZeRO-3", "Slapo-TP", "Slapo-ZeRO3"]
    notes = [t.get_text() for t in fig.legends[1].get_texts()]
    assert notes[0] == plots.WHISKER_NOTE and notes[1].startswith("X:")
    plots.save(fig, tmp_path / "e2e.pdf")
    assert (tmp_path / "e2e.pdf").read_bytes()[:4] == b"%PDF"


def test_figure9_labels_speedups_and_marks_failures(tmp_path):
    df = aggregate.ablation_table(ablation_records(tmp_path, (5, 7, None, 11)))
    fig = plots.figure9(df)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.texts]
    assert "1.00x" in labels and "1.40x" in labels and "2.20x" in labels
    assert "failed" in labels
    assert x_marks(fig) == 1


def whiskers(ax) -> list[tuple[float, float, float]]:
    """``(x, low, high)`` of each whisker an axis draws (errorbar's vertical segments)."""
    found = []
    for collection in ax.collections:
        for (x0, y0), (x1, y1) in (seg[:2] for seg in collection.get_segments()
                                     if len(seg) >= 2):
            if x0 == x1:
                found.append((round(float(x0), 6), float(min(y0, y1)), float(max(y0, y1))))
    return sorted(found)


def test_figures_7_and_9_whisker_each_bar_from_q1_to_q3_of_the_csv(tmp_path):
    """The whiskers are the records' quartiles, read back from the CSV alone; a row without
    quartiles is a bar without one, a case not ok has neither."""
    paths = [rec(tmp_path, "e2e", "megatron", "bert-xlarge", 2, 10, quartiles=(9.0, 10.5)),
             rec(tmp_path, "e2e", "deepspeed", "bert-xlarge", 2, 12, quartiles=(11.5, 13.0)),
             rec(tmp_path, "e2e", "slapo-megatron", "bert-xlarge", 2, 15),  # no quartiles
             rec(tmp_path, "e2e", "slapo-deepspeed", "bert-xlarge", 2, status="oom")]
    csv = aggregate.write_csv(aggregate.table(paths), tmp_path / "e2e.csv")
    ax = plots.figure7(pd.read_csv(csv)).axes[0]
    width = 0.8 / 4
    assert whiskers(ax) == [(round(-1.5 * width, 6), 9.0, 10.5),
                            (round(-0.5 * width, 6), 11.5, 13.0)]
    assert ax.get_ylim()[1] >= 13.0  # the highest whisker fits

    steps = [("eager", 1, 5, (4.5, 5.5)), ("slapo-kernel", 1, 7, (6.0, 8.5)),
             ("slapo-tp-attn-ffn", 2, None, None), ("slapo-tp-full", 2, 11, (10.0, 12.0))]
    paths = [rec(tmp_path, "ablation", m, "bert-xlarge", g, r, status="ok" if r else "failed",
                 quartiles=q) for m, g, r, q in steps]
    csv = aggregate.write_csv(aggregate.ablation_table(paths), tmp_path / "ablation.csv")
    ax = plots.figure9(pd.read_csv(csv)).axes[0]
    assert whiskers(ax) == [(0, 4.5, 5.5), (1, 6.0, 8.5), (3, 10.0, 12.0)]
    # each speedup label sits above its whisker
    label = next(t for t in ax.texts if t.get_text() == "1.40x")
    assert label.get_position()[1] > 8.5


def test_figure8_whiskers_come_from_its_csv(tmp_path):
    paths = [mrec(tmp_path, "megatron", "llama-7b", 16, 9.0, quartiles=(8.5, 9.5)),
             mrec(tmp_path, "slapo-megatron", "llama-7b", 16, 11.0, quartiles=(10.0, 12.5))]
    csv = aggregate.write_csv(aggregate.table(paths), tmp_path / "m.csv")
    ax = plots.figure8(pd.read_csv(csv)).axes[0]
    assert [(low, high) for _, low, high in whiskers(ax)] == [(8.5, 9.5), (10.0, 12.5)]
    assert next(t for t in ax.texts if t.get_text() == "1.22x").get_position()[1] > 12.5


def test_model_order_follows_the_paper():
    order = plots.model_order(["wideresnet-2.4B", "t5-3b", "bert-xlarge", "facebook/opt-2.7b",
                               "gpt-neo-2.9B", "roberta-xlarge"])
    assert order == ["bert-xlarge", "roberta-xlarge", "gpt-neo-2.9B", "facebook/opt-2.7b",
                     "t5-3b", "wideresnet-2.4B"]


def test_claims_c1_c2_on_records(tmp_path):
    e2e = aggregate.table(e2e_records(tmp_path, env=GPU))
    c1 = claims.check_c1(e2e)
    points = {p["model"]: p for p in c1["points"]}
    assert points["bert-xlarge"]["verdict"] == "PASS"
    assert points["roberta-xlarge"]["verdict"] == "FAIL"  # DeepSpeed 20 > Slapo-TP 18
    assert c1["verdict"] == "FAIL" and c1["counts"] == {"PASS": 1, "FAIL": 1,
                                                        "INCONCLUSIVE": 0, "NOT-RUN": 0}
    assert points["bert-xlarge"]["hardware"] == "NVIDIA H200 x2 @g"
    c2 = claims.check_c2(e2e)
    assert c2["single_node"]["measured_max"] == pytest.approx(1.25)
    assert c2["single_node"]["paper"] == 2.92 and c2["multi_node"]["paper"] == 1.41
    assert c2["single_node"]["verdict"] == "PASS" and c2["multi_node"]["verdict"] == "NOT-RUN"
    assert {p["model"]: round(p["speedup"], 2) for p in c2["points"]} == {
        "bert-xlarge": 1.25, "roberta-xlarge": 0.9}


def test_overlapping_spreads_are_inconclusive_not_a_verdict(tmp_path):
    """Slapo's median is higher but the interquartile ranges overlap: no PASS; a clear gap
    either way is decided (the noise rule)."""
    def point(slapo, base, tag):
        paths = [rec(tmp_path / tag, "e2e", "slapo-megatron", "bert-xlarge", 2, slapo[0],
                     quartiles=slapo[1:]),
                 rec(tmp_path / tag, "e2e", "megatron", "bert-xlarge", 2, base[0],
                     quartiles=base[1:])]
        e2e = aggregate.table(paths)
        return claims.check_c1(e2e), claims.check_c2(e2e)

    c1, c2 = point((15, 13, 16), (14, 12, 15.5), "overlap")
    assert c1["verdict"] == c1["points"][0]["verdict"] == "INCONCLUSIVE"
    assert "15 [13-16] within the noise of Megatron-LM 14 [12-15.5]" in c1["points"][0]["why"]
    assert c2["points"][0]["verdict"] == "INCONCLUSIVE"
    assert c2["points"][0]["speedup_range"] == pytest.approx([13 / 15.5, 16 / 12])
    assert c2["single_node"]["verdict"] == "INCONCLUSIVE"
    c1, c2 = point((15, 14.5, 16), (12, 11, 13), "clear")
    assert c1["verdict"] == "PASS" and c2["single_node"]["verdict"] == "PASS"
    c1, c2 = point((10, 9, 11), (14, 12, 15.5), "behind")
    assert c1["verdict"] == "FAIL" and c2["single_node"]["verdict"] == "FAIL"
    # a threshold above 1 needs the whole range above it
    e2e = aggregate.table([rec(tmp_path / "t", "e2e", "slapo-megatron", "bert-xlarge", 2, 15,
                               quartiles=(14.5, 16)),
                           rec(tmp_path / "t", "e2e", "megatron", "bert-xlarge", 2, 12,
                               quartiles=(11, 13))])
    assert claims.check_c2(e2e, 1.2)["points"][0]["verdict"] == "INCONCLUSIVE"  # 1.12 .. 1.45


def test_claim_verdicts_combine_fail_then_inconclusive_then_pass():
    points = lambda *vs: [{"verdict": v} for v in vs]  # noqa: E731
    assert claims.verdict(points("PASS", "INCONCLUSIVE")) == "INCONCLUSIVE"
    assert claims.verdict(points("PASS", "INCONCLUSIVE", "FAIL")) == "FAIL"
    assert claims.verdict(points("PASS", "NOT-RUN")) == "PASS"
    assert claims.verdict(points("NOT-RUN")) == "NOT-RUN"


def test_claims_not_run_without_data(tmp_path):
    result = claims.check_all(None, None, None)
    assert [c["verdict"] for c in result["claims"]] == ["NOT-RUN"] * 4
    assert "NOT-RUN" in result["setting"]
    # only failures: nothing ran ok -> NOT-RUN, not FAIL
    paths = [rec(tmp_path, "e2e", m, "bert-xlarge", 2, status="failed")
             for m in aggregate.SYSTEMS]
    e2e = aggregate.table(paths)
    assert claims.check_c1(e2e)["verdict"] == "NOT-RUN"
    assert claims.check_c2(e2e)["single_node"]["verdict"] == "NOT-RUN"


def test_claim_c1_slapo_oom_while_baseline_ran_fails(tmp_path):
    paths = [rec(tmp_path, "e2e", "deepspeed", "t5-3b", 2, 3),
             rec(tmp_path, "e2e", "slapo-deepspeed", "t5-3b", 2, status="oom"),
             rec(tmp_path, "e2e", "slapo-megatron", "t5-3b", 2, status="oom")]
    assert claims.check_c1(aggregate.table(paths))["verdict"] == "FAIL"


@pytest.mark.parametrize("other", ["unsupported", "failed", None])
def test_claim_c1_slapo_failing_where_a_baseline_ran_fails_the_point(tmp_path, other):
    """A crash (or timeout) of Slapo is a failed point, not a missing one: with other points
    passing, the claim must not pass. Only where each Slapo system is unsupported (or has no
    case) is the point NOT-RUN."""
    paths = [rec(tmp_path, "e2e", m, "bert-xlarge", 2, r) for m, r in
             [("megatron", 10), ("deepspeed", 8), ("slapo-megatron", 12), ("slapo-deepspeed", 9)]]
    paths += [rec(tmp_path, "e2e", "megatron", "t5-3b", 2, 3),
              rec(tmp_path, "e2e", "slapo-megatron", "t5-3b", 2, status="failed")]
    if other:
        paths.append(rec(tmp_path, "e2e", "slapo-deepspeed", "t5-3b", 2, status=other))
    c1 = claims.check_c1(aggregate.table(paths))
    t5 = next(p for p in c1["points"] if p["model"] == "t5-3b")
    assert t5["verdict"] == "FAIL" and c1["verdict"] == "FAIL"
    assert t5["why"].startswith("Slapo-TP failed") and t5["why"].endswith("where a baseline ran ok")
    # each Slapo system unsupported: NOT-RUN, and the claim stands on the points that ran
    paths = [p for p in paths if "t5-3b" not in str(p)]
    paths.append(rec(tmp_path / "u", "e2e", "slapo-megatron", "t5-3b", 2, status="unsupported"))
    paths.append(rec(tmp_path / "u", "e2e", "megatron", "t5-3b", 2, 3))
    c1 = claims.check_c1(aggregate.table(paths))
    t5 = next(p for p in c1["points"] if p["model"] == "t5-3b")
    assert t5["verdict"] == "NOT-RUN" and c1["verdict"] == "PASS"
    assert t5["why"] == "Slapo-TP unsupported: nothing to compare with a baseline"


def test_claim_c4_steps(tmp_path):
    # the last step failed where the one before ran: a failed step, as a slower one is
    c4 = claims.check_c4(aggregate.ablation_table(ablation_records(tmp_path, (5, 7, 6, None))))
    assert [p["verdict"] for p in c4["points"]] == ["PASS", "FAIL", "FAIL"]
    assert c4["points"][2]["why"] == "+ Embedding TP failed where + Attn/FFN TP ran ok"
    assert c4["verdict"] == "FAIL"
    # a step the profile cannot run (one GPU: no tensor parallelism) is NOT-RUN
    c4 = claims.check_c4(aggregate.ablation_table(ablation_records(tmp_path / "p", (5, 7))))
    assert [p["verdict"] for p in c4["points"]] == ["PASS", "NOT-RUN", "NOT-RUN"]
    assert c4["verdict"] == "PASS"


def test_claim_c4_step_within_the_noise_is_inconclusive(tmp_path):
    paths = [rec(tmp_path, "ablation", "eager", "bert-xlarge", 1, 10, quartiles=(9, 11)),
             rec(tmp_path, "ablation", "slapo-kernel", "bert-xlarge", 1, 10.5,
                 quartiles=(10, 11.5))]
    c4 = claims.check_c4(aggregate.ablation_table(paths))
    assert c4["points"][0]["verdict"] == "INCONCLUSIVE" and c4["verdict"] == "INCONCLUSIVE"
    assert "10.5 [10-11.5] within the noise of 10 [9-11]" in c4["points"][0]["why"]


def test_claim_c3_against_the_paper():
    loc = table4.loc_table(lambda family: {"artifact": 12 if family != "bert" else 40,
                                           "statements": 9})
    c3 = claims.check_c3(loc, max_ratio=1.5)
    verdicts = {p["model"]: p["verdict"] for p in c3["points"]}
    assert verdicts["BERT"] == "FAIL" and verdicts["WideResNet"] == "PASS"
    assert verdicts["OPT"] == "PASS"  # 12 <= 1.5 x 10


def test_claims_report_on_cpu_says_it_is_not_the_paper_setting(tmp_path):
    e2e = aggregate.table(e2e_records(tmp_path))
    ablation = aggregate.ablation_table(ablation_records(tmp_path))
    result = claims.check_all(e2e, ablation, table4.loc_table(lambda f: 1 / 0))
    text = claims.to_markdown(result)
    assert "CPU ranks" in result["setting"] and "not the paper's setting" in result["setting"]
    assert "| C3 | **NOT-RUN** |" in text and "ZeroDivisionError" in text
    assert "the paper's 2.92x not reached" in text and "(the paper: 1.41x)" in text
    assert "**Noise rule.** A throughput comparison is decided only when" in text
    assert "PASS / FAIL / INCONCLUSIVE / NOT-RUN" in text
    json.dumps(result, default=str)


def test_claims_cli_writes_md_and_json(tmp_path):
    e2e = aggregate.write_csv(aggregate.table(e2e_records(tmp_path)), tmp_path / "e.csv")
    rc = claims.main(["--e2e", str(e2e), "--ablation", str(tmp_path / "missing.csv"),
                      "--md", str(tmp_path / "c.md"), "--json", str(tmp_path / "c.json")])
    assert rc == 0
    data = json.loads((tmp_path / "c.json").read_text())
    assert [c["id"] for c in data["claims"]] == ["C1", "C2", "C3", "C4"]
    assert data["claims"][3]["verdict"] == "NOT-RUN"


# -- the report a reviewer quotes: its summary, C2's bar, headers, where and when ---------------
MEASURED = {"device_name": "cpu (x86_64)", "device_count": 0, "hostname": "vm",
            "git_commit": "d37561b0c0ffee0123456789", "cpu_model": "AMD EPYC 7B13",
            "cpu_count": 2, "torch": "2.13.0", "transformers": "5.24.0", "deepspeed": "0.19.8",
            "megatron_core": "0.16.1"}


def timed(paths, start_minute=0, commit=None):
    """The records at ``paths`` given start and end times a minute apart (10:00, 10:01, ...;
    each 30 s long) and, optionally, another commit."""
    for i, path in enumerate(paths):
        data = json.loads(path.read_text())
        minute = start_minute + i
        data["started_at"] = f"2026-12-04T10:{minute:02d}:00+00:00"
        data["finished_at"] = f"2026-12-04T10:{minute:02d}:30+00:00"
        if commit:
            data["env"]["git_commit"] = commit
        path.write_text(json.dumps(data))
    return paths


def report(e2e, ablation=None, multinode=None, recheck=None):
    loc = table4.loc_table(lambda family: {"artifact": 12, "statements": 9})
    result = claims.check_all(e2e, ablation, loc, multinode=multinode, recheck=recheck)
    return result, claims.to_markdown(result)


def test_claims_report_opens_with_three_lines_to_quote(tmp_path):
    e2e = aggregate.table(timed(e2e_records(tmp_path, env=MEASURED)))
    recheck = {"seconds": 96.4, "below": 1.25, "measured": 0, "repeated": 0, "steps": 24,
               "warmup": 4, "comparisons": {}}
    result, text = report(e2e, recheck=recheck)
    lines = text.splitlines()
    assert lines[0] == "# Claims of the Slapo paper, checked" and lines[1] == ""
    setting, verdicts, shows = lines[2:5]
    assert lines[5] == ""
    assert setting == ("- **Setting:** p profile, commit d37561b0c0ff, on CPU ranks over "
                       "gloo, no GPU (AMD EPYC 7B13, 2 cores) @vm, with torch 2.13.0, "
                       "transformers 5.24.0, DeepSpeed 0.19.8, megatron-core 0.16.1; the cases "
                       "ran 2026-12-04 10:00-10:07 UTC, 7.5 min wall, then the back-to-back "
                       "recheck 96 s.")
    assert verdicts.startswith("- **Verdicts:** C1 FAIL (1 PASS, 1 FAIL of 2 points); C2 PASS "
                               "(bar: speedup >= 1.0x beyond the noise; one node PASS, "
                               "largest 1.25x: the paper's 2.92x not reached (measured on "
                               "CPU ranks with a tiny model: not comparable with it); several "
                               "nodes "
                               "NOT-RUN: no multi-node cases in this profile")
    assert "C3 PASS (7 PASS of 7 points); C4 NOT-RUN (3 NOT-RUN of 3 points)." in verdicts
    assert shows.startswith("- **What they show:** Measured on CPU ranks")
    assert "INCONCLUSIVE means" in shows and "not that the paper's numbers reproduce" in shows
    assert "on 8 GPUs or more `make reproduce` picks profile `paper`" in shows  # the next step
    # the same in the JSON, with the facts behind the setting line
    assert result["summary"]["setting"] == setting.removeprefix("- **Setting:** ")
    run = result["run"]
    assert run["commits"] == ["d37561b0c0ffee0123456789"] and run["cpu_models"] == [
        "AMD EPYC 7B13"]
    assert (run["cases_wall_s"], run["recheck_s"], run["records"]) == (450.0, 96.4, 8)
    assert (run["first_start"], run["last_finish"]) == ("2026-12-04T10:00:00+00:00",
                                                        "2026-12-04T10:07:30+00:00")
    # the per-point hardware names the CPU model too
    assert "cpu (x86_64) AMD EPYC 7B13, 2 ranks @vm" in text


def test_claims_report_names_the_gpu_every_commit_and_when_the_paper_was_reached(tmp_path):
    gpu = {**MEASURED, "device_name": "NVIDIA H200", "device_count": 2, "hostname": "g"}
    rows = [("megatron", 10), ("deepspeed", 10), ("slapo-megatron", 30), ("slapo-deepspeed", 20)]
    paths = [rec(tmp_path, "e2e", m, "bert-xlarge", 2, r, env=gpu) for m, r in rows]
    timed(paths[:2])
    timed(paths[2:], start_minute=2, commit="aaaabbbbccccdddd+dirty")
    result, text = report(aggregate.table(paths))
    setting = result["summary"]["setting"]
    assert ("on NVIDIA H200 GPUs (up to 2 a case; host CPU AMD EPYC 7B13, 2 cores) @g"
            in setting)
    assert ("commits d37561b0c0ff, aaaabbbbcccc+dirty (the records come from more than one)"
            in setting)
    assert "the back-to-back recheck" not in setting  # none ran
    assert "one node PASS, largest 3x: the paper's 2.92x reached" in result["summary"]["verdicts"]
    assert "## C2: PASS (bar: speedup >= 1.0x)" in text
    assert "The paper used 8 x V100 32 GB with fp16" in result["summary"]["shows"]
    # C2's table: why each verdict (the speedup with its spread, against the bar), and the
    # best system of each side with its samples/s
    header = next(line for line in text.splitlines() if line.startswith("| model | GPUs | nodes"))
    assert header == ("| model | GPUs | nodes | verdict | why | best Slapo (samples/s) | "
                      "best baseline (samples/s) | hardware |")
    row = next(line for line in text.splitlines() if line.startswith("| bert-xlarge | 2 | 1 |"))
    assert row.startswith("| bert-xlarge | 2 | 1 | PASS | 3.00x [")
    assert "] >= 1.0x | Slapo-TP 30 | Megatron-LM 10 |" in row


def test_claims_report_without_env_or_times_says_what_it_lacks(tmp_path):
    result, _ = report(aggregate.table(e2e_records(tmp_path)))
    setting = result["summary"]["setting"]
    assert "commit unknown (the records name none)" in setting
    assert "a CPU of unknown model" in setting and "the records give no times" in setting
    empty, text = report(None)
    assert empty["summary"]["setting"] == "no profile; no benchmark records."
    assert "C1 NOT-RUN (no data points)" in empty["summary"]["verdicts"]


def test_every_table_of_the_claims_report_has_a_header_for_each_column(tmp_path):
    e2e = aggregate.table(timed(e2e_records(tmp_path, env=MEASURED)))
    ablation = aggregate.ablation_table(ablation_records(tmp_path))
    multinode = aggregate.table(multinode_records(tmp_path / "m"))
    _, text = report(e2e, ablation, multinode)
    lines = text.splitlines()
    headers = [line for i, line in enumerate(lines)
               if line.startswith("|") and not lines[i - 1].startswith("|")]
    assert len(headers) == 5  # the summary, then C1 to C4
    for header in headers:
        cells = [cell.strip() for cell in header.strip("|").split("|")]
        assert all(cells), f"a column without a header: {header}"
    # each row has as many cells as its header
    for i, line in enumerate(lines):
        if line.startswith("|") and lines[i - 1].startswith("|"):
            start = max(j for j in range(i + 1) if lines[j] in headers)
            assert line.count("|") == lines[start].count("|"), line


def test_the_noise_rule_reads_in_short_sentences():
    sentences = [s for s in claims.NOISE_RULE.split(". ") if s]
    assert len(sentences) >= 4 and max(len(s.split()) for s in sentences) <= 20
    sentences = [s for s in claims.BACK_TO_BACK_RULE.split(". ") if s]
    assert len(sentences) >= 4 and max(len(s.split()) for s in sentences) <= 20


def test_table4_outputs():
    df = table4.loc_table(lambda family: {"artifact": 5, "statements": 4}
                          if family != "t5" else (_ for _ in ()).throw(FileNotFoundError("t5")))
    assert list(df["model"]) == ["WideResNet", "T5", "RoBERTa", "LLaMA", "OPT", "BERT", "GPT"]
    assert list(df["paper_loc"]) == [12, 11, 21, 11, 10, 21, 10]
    assert df.set_index("model").loc["T5", "status"] == "missing"
    md = table4.to_markdown(df)
    assert "| BERT | 21 | 5 | 4 |" in md and "| T5 | 11 | - | - |" in md
    tex = table4.to_latex(df)
    assert r"\begin{tabular}{lrrrrrrr}" in tex and "LoC (paper) & 12 & 11 & 21" in tex


# -- Figure 8 (multi-node) and C2's multi-node half ------------------------------------------
def mrec(tmp_path, mode, model, gpus, rate=None, status="ok", quartiles=None, per_node=8):
    """A record of a case on ``gpus // per_node`` nodes; the megatron modes pipeline 2 x
    tensor 8 with micro-batch 4, as Figure 8's."""
    path = rec(tmp_path, "multinode", mode, model, gpus, rate, status=status, env=GPU,
               batch=256, quartiles=quartiles)
    data = json.loads(path.read_text())
    nodes = gpus // per_node
    layout = ({"pp": 2, "tp": 8, "dp": gpus // 16, "micro_batch": 4} if "megatron" in mode
              else {"pp": 1, "tp": 1, "dp": gpus, "micro_batch": 256 // gpus})
    data["case"].update(id=f"{mode}__{model}__g{gpus}__n{nodes}", nodes=nodes,
                        gpus_per_node=per_node, **layout)
    path.write_text(json.dumps(data))
    return path


def multinode_records(tmp_path):
    rates = {16: (9.0, 10.0, 11.0), 32: (16.0, 19.0, 22.0)}  # megatron, deepspeed, slapo
    paths = [mrec(tmp_path, mode, "llama-7b", g, r) for g, row in rates.items()
             for mode, r in zip(("megatron", "deepspeed", "slapo-megatron"), row)]
    paths += [mrec(tmp_path, "megatron", "llama-7b", 64, status="oom"),
              mrec(tmp_path, "deepspeed", "llama-7b", 64, 24.0),
              mrec(tmp_path, "slapo-megatron", "llama-7b", 64, status="failed")]
    return paths


def test_multinode_table_has_nodes_and_layout(tmp_path):
    df = aggregate.table(multinode_records(tmp_path))
    assert len(df) == 9 and list(df.columns) == aggregate.COLUMNS
    row = df[df["case_id"] == "slapo-megatron__llama-7b__g32__n4"].iloc[0]
    assert (row["experiment"], row["nodes"], row["gpus_per_node"]) == ("multinode", 4, 8)
    assert (row["pp"], row["tp"], row["dp"], row["micro_batch"]) == (2, 8, 2, 4)
    assert row["system"] == "Slapo-3D" and row["model_label"] == "LLaMA-7B"
    assert aggregate.system_label("slapo-megatron", 1) == "Slapo-TP"


def test_figure8_marks_non_ok_bars_prints_speedups_and_nodes(tmp_path):
    df = aggregate.table(multinode_records(tmp_path))
    fig = plots.figure8(df)
    assert x_marks(fig) == 2
    ax = fig.axes[0]
    assert ax.get_title() == "LLaMA-7B (llama-7b)"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["16\n2 x 8", "32\n4 x 8",
                                                            "64\n8 x 8"]
    assert sorted(t.get_text() for t in ax.texts) == ["1.10x", "1.16x"]  # over the best baseline
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == ["Megatron-LM", "DeepSpeed ZeRO-3", "Slapo"]
    assert [t.get_text() for t in fig.legends[1].get_texts()][1].startswith("X:")
    plots.save(fig, tmp_path / "multinode.pdf")
    assert (tmp_path / "multinode.pdf").read_bytes()[:4] == b"%PDF"
    # a system without a case at a GPU count is an X as well
    assert x_marks(plots.figure8(df[df["case_id"] != "deepspeed__llama-7b__g64__n8"])) == 3
    # a profile without multi-node cases: an empty figure that says so
    empty = aggregate.write_csv(aggregate.table([]), tmp_path / "m.csv")
    assert plots.main(["multinode", str(empty), str(tmp_path / "empty.pdf")]) == 0
    assert x_marks(plots.figure8(pd.read_csv(empty))) == 0


def test_claim_c2_multi_node_half_is_checked_from_figure8(tmp_path):
    multinode = aggregate.table(multinode_records(tmp_path))
    e2e = aggregate.table(e2e_records(tmp_path, env=GPU))
    c2 = claims.check_c2(e2e, multinode=multinode)
    multi = c2["multi_node"]
    assert multi["verdict"] == "PASS" and multi["paper"] == 1.41
    assert multi["measured_max"] == pytest.approx(22 / 19)
    assert multi["at"] == {"model": "llama-7b", "gpus": 32}
    assert multi["hardware"] == "NVIDIA H200 x32 on 4 nodes @g"
    points = {(p["gpus"], p["nodes"]): p for p in c2["points"] if p["nodes"] > 1}
    # Slapo failed where DeepSpeed ran: a failed point, though C2 ("up to") passes
    assert [p["verdict"] for p in points.values()] == ["PASS", "PASS", "FAIL"]
    assert points[(16, 2)]["best_slapo"]["system"] == "Slapo-3D"
    assert points[(64, 8)]["why"] == "Slapo-TP failed where a baseline ran ok"
    assert c2["single_node"]["verdict"] == "PASS" and c2["verdict"] == "PASS"
    text = claims.to_markdown(claims.check_all(e2e, None, None, multinode=multinode))
    assert "several nodes PASS, largest 1.158x: the paper's 1.41x not reached" in text
    assert "- Several nodes (up to 64 GPUs): **PASS** against the bar of 1.0x; the largest " \
           "speedup 1.158x (llama-7b, 32 GPUs, on NVIDIA H200 x32 on 4 nodes @g): the " \
           "paper's 1.41x not reached." in text
    # slower than a baseline on several nodes: the half fails, and so the claim
    slow = aggregate.table([mrec(tmp_path / "slow", "slapo-megatron", "llama-7b", 16, 8.0,
                                 quartiles=(7.5, 8.5)),
                            mrec(tmp_path / "slow", "deepspeed", "llama-7b", 16, 10.0,
                                 quartiles=(9.5, 10.5))])
    c2 = claims.check_c2(e2e, multinode=slow)
    assert c2["multi_node"]["verdict"] == "FAIL" and c2["verdict"] == "FAIL"


def test_claim_c2_multi_node_half_is_not_run_without_its_cases(tmp_path):
    e2e = aggregate.table(e2e_records(tmp_path, env=GPU))
    for multinode in (None, aggregate.table([])):
        c2 = claims.check_c2(e2e, multinode=multinode)
        assert c2["multi_node"]["verdict"] == "NOT-RUN" and c2["verdict"] == "PASS"
        assert "no multi-node cases in this profile" in c2["multi_node"]["why"]
    text = claims.to_markdown(claims.check_all(e2e, None, None))
    assert "- Several nodes (up to 64 GPUs): **NOT-RUN**: no multi-node cases in this " \
           "profile" in text
    assert "max speedup -x" not in text and "largest -x" not in text
    # only the multi-node cases ran (profile cpu-multinode): the claim is their half's
    multinode = aggregate.table(multinode_records(tmp_path / "m"))
    c2 = claims.check_c2(None, multinode=multinode)
    assert c2["single_node"]["verdict"] == "NOT-RUN" and c2["verdict"] == "PASS"


def test_claims_cli_reads_the_multinode_csv(tmp_path):
    csv = aggregate.write_csv(aggregate.table(multinode_records(tmp_path)), tmp_path / "m.csv")
    assert claims.main(["--multinode", str(csv), "--md", str(tmp_path / "c.md"),
                        "--json", str(tmp_path / "c.json")]) == 0
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["claims"][1]["multi_node"]["verdict"] == "PASS"
    assert data["profile"] == "p"
    assert aggregate.main(["--experiment", "multinode", "--out", str(tmp_path / "o.csv"),
                           *map(str, multinode_records(tmp_path / "again"))]) == 0
