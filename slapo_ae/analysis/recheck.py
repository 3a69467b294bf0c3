"""Close comparisons measured again, back to back: the check against this machine's drift
(``results/recheck.json``, read by :mod:`.claims` and :mod:`.gaps`).

The claims (C1, C2, C4) and Slapo beside its own engine compare cases that ran minutes apart.
On a shared machine, speed drifts between runs by more than it varies within one: the same
case run twice a minute apart gave medians 20 to 30% apart here (docs/workflow.md), so the
noise rule, which compares the interquartile ranges of each run's steps, can decide a
comparison that the next pair of runs reverses. Every comparison the noise rule decides by a
margin below ``--below`` (:func:`slapo_ae.analysis.claims.margin`: how far the two ranges stand
apart; default 1.25, this machine's drift) is therefore run again: both cases back to back,
with the profile's steps, the order alternating from one comparison to the next. The closest
``--max`` comparisons are measured; a verdict then stands only if the pair run back to back
gives the same one and, where it does, the case that ran first runs once more (``repeat``,
after the second) and the verdict must hold against that run too
(:func:`slapo_ae.analysis.claims.after_recheck`). One pair is not enough here: on t5-tiny at
2 ranks a pair confirmed Slapo-TP at 0.89x of Megatron-LM, and six interleaved rounds of the
same cases gave 0.98 [0.85-1.11] beside an A/A ratio (the same case twice) of 1.00
[0.88-1.14] (docs/workflow.md, 2026-12-03). The repeat is run only for a pair that agreed, so
it costs one case run per verdict that would otherwise stand. A close comparison past
``--max`` keeps its verdict, and its entry (``rerun`` null, ``skipped`` saying why) makes the
verdicts say that it was close and not measured again. Both directions are
measured alike: a close PASS is re-measured as a close FAIL is.

A point where Slapo trails its own engine (or an ablation step the one before it,
:func:`slapo_ae.analysis.gaps.target_points`) is measured again first, whatever its margin and
outside ``--max``: it is the finding the targets report and profile, and here one pair of runs
minutes apart put Slapo-ZeRO3 at 0.66x of ZeRO-3 by a margin above 1.25 where four pairs back
to back gave 0.89x to 1.34x (docs/workflow.md). A run has none to a few such points.

``--budget-s`` bounds the time the others take: none is started once that many seconds have
passed since the recheck began (the trailing points' runs count), nor one whose runs would end
past them (its cases' own run times, the repeat included, foretell its cost), and those left
are marked as past the limit. The budget also covers the profiles that follow (rule ``gaps``:
both cases of every point still behind once measured again, at their own run times). The
number of close calls changes from run to run (7 and 12 in two runs of the cpu profile on
2026-12-03, whose rechecks took 169 and 385 s), so a count alone does not keep the run's time.
With ``--time-target-s`` the budget is also at most what the workflow's time target leaves
after the cases' runs (the rows' start-to-end seconds) and ``--reserved-s`` for its other
steps: the same machine ran the same cases of the cpu profile in 5.8 to 7.1 minutes on
different days, so a fixed budget either wastes the quick days or overruns the slow ones.

    python -m slapo_ae.analysis.recheck --e2e results/e2e.csv --ablation results/ablation.csv \\
        --out results/recheck.json --runs results/recheck --steps 24 --warmup 4
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from slapo_ae.analysis.claims import (
    FAIL,
    INCONCLUSIVE,
    NOT_RUN,
    after_recheck,
    check_c1,
    check_c4,
    compare,
    margin,
    pair_key,
    read_table,
    run_seconds,
    table_rows,
)
from slapo_ae.analysis.gaps import MAX_PROFILES, target_points
from slapo_ae.analysis.rerun import case_fields, run_again
from slapo_ae.atomic import write_text
from slapo_ae.harness.runner import DEFAULT_HARNESS

DRIFT = 1.25  # the margin below which a decided comparison is measured again
MAX_RECHECKS = 8  # the workflow's claims.max_rechecks


def comparisons(e2e, ablation) -> list[tuple[dict, dict]]:
    """Every comparison the claims and Slapo beside its engine make on the aggregate tables
    ``e2e`` and ``ablation`` (DataFrames or None), as (row a, row b) with a judged against b,
    each pair once."""
    e2e_rows, ablation_rows = table_rows(e2e), table_rows(ablation)
    rows = {r.get("case_id"): r for r in e2e_rows + ablation_rows}
    pairs = {}
    for claim in (check_c1(e2e), check_c4(ablation)):
        for point in claim["points"]:
            if point.get("compared"):
                a, b = (rows[case_id] for case_id in point["compared"])
                pairs.setdefault(pair_key(a, b), (a, b))
    for point in target_points(e2e_rows, ablation_rows):
        a, b = rows[point["slapo"]["case_id"]], rows[point["baseline"]["case_id"]]
        pairs.setdefault(pair_key(a, b), (a, b))
    return list(pairs.values())


def close_calls(pairs, below: float = DRIFT) -> list[tuple[dict, dict, str, float]]:
    """The decided comparisons whose margin is below ``below``, closest first, as (a, b,
    verdict, margin)."""
    close = []
    for a, b in pairs:
        decided = compare(a, b)
        if decided in (INCONCLUSIVE, NOT_RUN):
            continue
        m = margin(a, b, decided)
        if m is not None and m < below:
            close.append((a, b, decided, m))
    return sorted(close, key=lambda c: c[3])


def trailing_calls(e2e, ablation) -> list[tuple[dict, dict, str, float]]:
    """The points of the targets where Slapo is behind, by any margin, as (a, b, verdict,
    margin), closest first."""
    e2e_rows, ablation_rows = table_rows(e2e), table_rows(ablation)
    rows = {r.get("case_id"): r for r in e2e_rows + ablation_rows}
    trailing = []
    for point in target_points(e2e_rows, ablation_rows):
        a, b = rows[point["slapo"]["case_id"]], rows[point["baseline"]["case_id"]]
        if compare(a, b) == FAIL:
            trailing.append((a, b, FAIL, margin(a, b, FAIL)))
    return sorted(trailing, key=lambda c: c[3])


def time_budget(e2e, ablation, budget_s: float | None, target_s: float | None,
                reserved_s: float = 0.0) -> tuple[float | None, dict]:
    """The recheck's budget: ``budget_s``, and with a time target ``target_s`` at most what it
    leaves after the cases' runs in ``e2e`` and ``ablation`` and ``reserved_s`` (never below
    0), with what it was computed from."""
    if target_s is None:
        return budget_s, {"budget_s": budget_s}
    cases_s = sum(run_seconds(r) or 0.0 for r in table_rows(e2e) + table_rows(ablation))
    left = max(0.0, target_s - cases_s - reserved_s)
    budget = left if budget_s is None else min(budget_s, left)
    return budget, {"budget_s": budget_s, "target_s": target_s, "cases_s": round(cases_s, 1),
                    "reserved_s": reserved_s, "left_s": round(left, 1)}


def expected_seconds(a: dict, b: dict) -> float:
    """What measuring ``a`` against ``b`` again should cost: both cases and the repeat of
    one, at the cases' own run times (0 for a case without times)."""
    walls = [run_seconds(a) or 0.0, run_seconds(b) or 0.0]
    return sum(walls) + max(walls)


def measured_row(record) -> dict:
    """The fields of a rerun's record that the noise rule reads (as an aggregate row has
    them)."""
    row = {"status": record.status if record else "failed"}
    metrics = record.metrics if record and record.status == "ok" else None
    if metrics is not None:
        spread = metrics.spread or {}
        row.update(samples_per_s=metrics.samples_per_s,
                   samples_per_s_q1=spread.get("q1"), samples_per_s_q3=spread.get("q3"))
    return row


def recheck(e2e, ablation, runs: Path, steps: int, warmup: int, device: str = "cpu",
            dtype: str = "fp32", below: float = DRIFT, most: int = MAX_RECHECKS,
            harness: str = DEFAULT_HARNESS, budget_s: float | None = None,
            target_s: float | None = None, reserved_s: float = 0.0,
            clock=time.monotonic, timeout: float | None = None, reruns: bool = True) -> dict:
    """Measure again the points where Slapo trails, then the closest ``most`` of the other
    close calls, each of those only if it should end within the budget (seconds from the
    start, the trailing points' runs included; :func:`time_budget`); ``timeout``: each
    rerun's (the profile's for a case). ``reruns=False`` (a profile's ``reruns: false``, a
    smoke test's) measures none and says so for each."""
    budget, basis = time_budget(e2e, ablation, budget_s, target_s, reserved_s)
    close = close_calls(comparisons(e2e, ablation), below)
    trailing = trailing_calls(e2e, ablation)
    behind = {pair_key(a, b) for a, b, _, _ in trailing}
    others = [c for c in close if pair_key(c[0], c[1]) not in behind]
    started = clock()
    measured, skipped = {}, []
    profiles_s, still_behind = 0.0, 0  # what rule gaps will spend profiling those points
    for i, (a, b, decided, m) in enumerate(trailing + others):
        why = None if reruns else "the profile reruns no case (reruns: false)"
        if why is None and i >= len(trailing):  # where Slapo is not behind: within the limits
            spent, cost = clock() - started + profiles_s, expected_seconds(a, b)
            if i - len(trailing) >= most:
                why = f"only the {most} closest of {len(others)} are measured (--max)"
            elif budget is not None and spent >= budget:
                why = f"the recheck's {budget:.0f} s{_source(basis)} were spent"
            elif budget is not None and spent + cost > budget:
                why = (f"its runs (about {cost:.0f} s) would end past the recheck's "
                       f"{budget:.0f} s{_source(basis)}")
        if why:
            skipped.append(pair_key(a, b))
            measured[pair_key(a, b)] = {
                "a": a["case_id"], "b": b["case_id"], "verdict": decided, "margin": m,
                "rerun": None, "verdict_again": None, "skipped": why}
            continue
        measured[pair_key(a, b)] = entry = _measure(a, b, decided, m, i, runs, steps, warmup,
                                                    device, dtype, harness, timeout)
        if (i < len(trailing) and still_behind < MAX_PROFILES
                and after_recheck(FAIL, a, b, {pair_key(a, b): entry})[0] == FAIL):
            still_behind += 1
            profiles_s += (run_seconds(a) or 0.0) + (run_seconds(b) or 0.0)
        print(f"{a['case_id']} vs {b['case_id']}: {decided} (margin {m:.3f}) -> back to back "
              f"{entry['verdict_again']}" + (f", against the repeat {entry['verdict_repeat']}"
                                             if "repeat" in entry else ""), flush=True)
    return {"below": below, "steps": steps, "warmup": warmup, "device": device,
            "close": len(close), "trailing": len(trailing),
            "measured": len(measured) - len(skipped),
            "repeated": sum("repeat" in entry for entry in measured.values()),
            "budget_s": budget, "budget": basis, "seconds": round(clock() - started, 1),
            "profiles_expected_s": round(profiles_s, 1),
            "not_measured": skipped, "comparisons": measured}


def _source(basis: dict) -> str:
    """Where the budget came from, for a skipped comparison's reason."""
    if basis.get("target_s") is None or (basis["budget_s"] is not None
                                         and basis["budget_s"] <= basis["left_s"]):
        return " (--budget-s)"
    return (f" (the time target's {basis['target_s']:g} s less {basis['cases_s']:.0f} s of "
            f"case runs and {basis['reserved_s']:g} s reserved)")


def _measure(a, b, decided, m, i, runs, steps, warmup, device, dtype, harness,
             timeout=None) -> dict:
    """The ``i``-th comparison, ``a`` against ``b``, run back to back (and its repeat)."""
    order = (b, a) if i % 2 == 0 else (a, b)  # whatever drifts, it favours neither side
    rerun = {}
    for row in order:
        record = run_again(case_fields(row), runs / str(row["case_id"]), steps, warmup,
                           device, dtype, harness, timeout=timeout)
        rerun[str(row["case_id"])] = {**measured_row(record), "case_id": row["case_id"]}
    again = compare(rerun[str(a["case_id"])], rerun[str(b["case_id"])])
    entry = {"a": a["case_id"], "b": b["case_id"], "verdict": decided, "margin": m,
             "order": [r["case_id"] for r in order], "rerun": rerun, "verdict_again": again}
    if again == decided:  # the pair agrees: the first case once more, after the second
        first, second = order[0], rerun[str(order[1]["case_id"])]
        record = run_again(case_fields(first), runs / f"{first['case_id']}.repeat", steps,
                           warmup, device, dtype, harness, timeout=timeout)
        entry["repeat"] = {**measured_row(record), "case_id": first["case_id"],
                           "mode": first["mode"]}
        entry["verdict_repeat"] = (compare(entry["repeat"], second) if first is a
                                   else compare(second, entry["repeat"]))
    return entry


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--e2e")
    parser.add_argument("--ablation")
    parser.add_argument("--out", required=True)
    parser.add_argument("--runs", required=True, help="folder of the reruns' records and logs")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "fp16", "bf16"))
    parser.add_argument("--below", type=float, default=DRIFT,
                        help="measure again the decided comparisons with a smaller margin")
    parser.add_argument("--max", type=int, default=MAX_RECHECKS, dest="most",
                        help="at most this many comparisons where Slapo is not behind, "
                             "the closest first")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no comparison where Slapo is not behind that would end "
                             "after this many seconds (default: no limit)")
    parser.add_argument("--time-target-s", type=float, default=None,
                        help="the workflow's time target: the budget is at most what it leaves "
                             "after the cases' runs and --reserved-s")
    parser.add_argument("--reserved-s", type=float, default=0.0,
                        help="seconds of the time target kept for the workflow's other steps")
    parser.add_argument("--harness", default=DEFAULT_HARNESS, help="the harness CLI")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds for each rerun (default: the harness's for the device)")
    parser.add_argument("--no-reruns", action="store_true",
                        help="measure nothing again; each comparison says why")
    args = parser.parse_args(argv)
    result = recheck(read_table(args.e2e), read_table(args.ablation), Path(args.runs),
                     args.steps, args.warmup, args.device, args.dtype, args.below, args.most,
                     args.harness, args.budget_s, args.time_target_s, args.reserved_s,
                     timeout=args.timeout, reruns=not args.no_reruns)
    write_text(args.out, json.dumps(result, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
