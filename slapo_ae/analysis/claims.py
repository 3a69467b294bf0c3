"""Machine-check the paper's claims C1-C4 (docs/paper.md) on whatever was run.

Each claim is checked per data point, with the numbers behind the verdict and the hardware
they came from (the records' ``env``):

- **C1** (Figure 7), per model and GPU count: the best Slapo system (``slapo-megatron`` or
  ``slapo-deepspeed``) against the best baseline: PASS if it is faster, FAIL if slower;
  NOT-RUN if no Slapo system ran ``ok`` and not all of them ran out of memory (a Slapo OOM
  where a baseline ran counts as FAIL), or if nothing ran.
- **C2** (abstract), per model and GPU count: the best Slapo system's samples/s over the best
  baseline's (DeepSpeed, Megatron-LM); PASS if at least ``c2_min_speedup`` (default 1.0).
  It has two halves: one node (the e2e cases, beside the paper's 2.92x on 8 V100) and several
  nodes (the multinode cases of Figure 8, beside the paper's 1.41x on up to 64 GPUs), each
  NOT-RUN without its cases. A half ("up to") passes if a point passes; its largest speedup
  is reported beside the paper's. The claim's verdict is its halves' (FAIL if one fails, ...).
- **C3** (Table 4), per model: PASS if its schedule's length by the artifact's rule is at
  most ``c3_max_ratio`` (default 1.5) times the paper's; NOT-RUN if there is no schedule.
- **C4** (Figure 9), per step: PASS if the step's samples/s exceeds the previous step's,
  FAIL if not; NOT-RUN if either did not run ``ok``.

**Noise rule** (C1, C2, C4): a throughput comparison is decided only when the two systems'
interquartile ranges of per-step samples/s (q1 to q3 of the timed steps) do not overlap, or for
a speedup threshold ``t``: PASS needs ``q1(a) / q3(b) >= t``, FAIL needs ``q3(a) / q1(b) < t``.
Anything in between is INCONCLUSIVE, reported with both medians and ranges: the gap is within
the noise of the steps measured. Records without a spread count as a point (q1 = q3 = median).

**Back to back** (:mod:`slapo_ae.analysis.recheck`): a comparison the noise rule decides by a
margin smaller than the machine's drift between runs was measured again, both cases one after
the other; its verdict stands only if that pair gives the same verdict and then also against a
repeat of the pair's first case, run after the second, else it is INCONCLUSIVE ("not
reproduced back to back").

A claim's verdict is FAIL if any point fails, else INCONCLUSIVE if any point is, else PASS if
any point passes, else NOT-RUN (C2: PASS if any point passes, since it claims "up to").

``claims.md`` opens with three lines a reviewer can quote: the setting (profile, commit, CPU
and GPU model, when the cases ran and for how long, all from the records), the verdicts (C2's
with its bar and whether the paper's 2.92x was reached), and what they do and do not show.
Slapo beside its own engine (:mod:`slapo_ae.analysis.gaps`) follows the claims as the
artifact's own check.

    python -m slapo_ae.analysis.claims --e2e results/e2e.csv --ablation results/ablation.csv \\
        --multinode results/multinode.csv --loc results/loc.csv --md results/claims.md \\
        --json results/claims.json
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import sys
from pathlib import Path

from slapo_ae.analysis.aggregate import (
    ABLATION_LABELS,
    ABLATION_STEPS,
    BASELINES,
    SLAPO_SYSTEMS,
    SYSTEM_LABELS,
    system_label,
)

PASS, FAIL, INCONCLUSIVE, NOT_RUN = "PASS", "FAIL", "INCONCLUSIVE", "NOT-RUN"
VERDICTS = (PASS, FAIL, INCONCLUSIVE, NOT_RUN)
NOISE_RULE = ("A throughput comparison is decided only when it stands out of the noise of the "
              "timed steps. Each run gives the quartiles q1 and q3 of its per-step samples/s. "
              "A is Slapo and B the baseline, or A an ablation step and B the one before. "
              "A passes when q1(A) / q3(B) >= t. It fails when q3(A) / q1(B) < t. "
              "Anything in between is INCONCLUSIVE. "
              "t is 1 for \"faster\" and the bar for C2. Medians are followed by [q1-q3].")
BACK_TO_BACK_RULE = ("This machine's speed drifts between runs by more than within one. "
                     "A comparison's margin is q1 of the faster over q3 of the slower. "
                     "A decided comparison whose margin is below {below}x was run again, both "
                     "cases back to back. Where that pair agreed, the case run first was run "
                     "once more. The verdict stands only if the pair and the repeat give it "
                     "too. Otherwise it is INCONCLUSIVE (not reproduced back to back). A point "
                     "where Slapo is behind its own engine is always run again, whatever its "
                     "margin.")
PAPER_C2 = {"single_node": 2.92, "multi_node": 1.41}
DEFAULTS = {"c2_min_speedup": 1.0, "c3_max_ratio": 1.5}
TITLES = {
    "C1": "On one node, for every model and GPU count, Slapo-TP or Slapo-ZeRO3 has the "
          "highest throughput among the four systems (Figure 7).",
    "C2": "Up to 2.92x training throughput over the best out-of-the-box baseline on one "
          "machine with 8 V100 GPUs; up to 1.41x on up to 64 GPUs (abstract).",
    "C3": "A model's schedule takes a few lines (Table 4).",
    "C4": "Each progressive step of the ablation raises throughput over the previous "
          "(Figure 9).",
}


def _num(value):
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(value) else value


def _present(value) -> bool:
    return value is not None and value == value and value != ""  # not None, NaN or empty


def ok_rate(row) -> float | None:
    """A row's samples/s if it ran ok, else None."""
    return _num(row.get("samples_per_s")) if row.get("status") == "ok" else None


def _quartiles(row) -> tuple[float, float]:
    """(q1, q3) of a row's per-step samples/s; the median twice where no spread was kept."""
    rate = ok_rate(row)
    q1, q3 = _num(row.get("samples_per_s_q1")), _num(row.get("samples_per_s_q3"))
    return (q1, q3) if q1 is not None and q3 is not None else (rate, rate)


def compare(a, b, threshold: float = 1.0) -> str:
    """Is row ``a`` at least ``threshold`` times as fast as row ``b``, beyond the noise?
    PASS if ``q1(a) / q3(b) >= threshold``, FAIL if ``q3(a) / q1(b) < threshold``, else
    INCONCLUSIVE (the noise rule, :data:`NOISE_RULE`)."""
    (a1, a3), (b1, b3) = _quartiles(a), _quartiles(b)
    if None in (a1, b1) or min(a1, b1) <= 0:  # a row not ok, or broken: decide nothing
        return INCONCLUSIVE
    if a1 / b3 >= threshold:
        return PASS
    if a3 / b1 < threshold:
        return FAIL
    return INCONCLUSIVE


def margin(a, b, decided: str) -> float | None:
    """How far a decided comparison of ``a`` with ``b`` stands out of the noise:
    ``q1(a) / q3(b)`` for a PASS, ``q1(b) / q3(a)`` for a FAIL (at least 1 when the threshold
    is 1); None for an undecided one."""
    (a1, a3), (b1, b3) = _quartiles(a), _quartiles(b)
    if decided == PASS:
        return a1 / b3
    if decided == FAIL:
        return b1 / a3
    return None


def pair_key(a, b) -> str:
    """The key of the comparison of rows ``a`` and ``b`` (their case ids) in recheck.json."""
    return " vs ".join(sorted([str(a.get("case_id")), str(b.get("case_id"))]))


def after_recheck(decided: str, a, b, rechecks: dict | None,
                  threshold: float = 1.0) -> tuple[str, str]:
    """The verdict of ``a`` against ``b`` once the back-to-back re-measurement is taken in
    (``rechecks``: recheck.json's ``comparisons`` by :func:`pair_key`), and a note on it
    ("" when the comparison was not close; a close one past the recheck's limit keeps its
    verdict and the note says it was not measured again)."""
    entry = (rechecks or {}).get(pair_key(a, b))
    if entry is None or decided in (INCONCLUSIVE, NOT_RUN):
        return decided, ""
    if entry.get("rerun") is None:  # close, but past the recheck's limit
        return decided, (f"; close (margin {entry['margin']:.3g}) but not measured back to "
                         f"back: {entry['skipped']}")
    again_a, again_b = (entry["rerun"].get(str(r.get("case_id"))) for r in (a, b))
    if not again_a or not again_b or ok_rate(again_a) is None or ok_rate(again_b) is None:
        return INCONCLUSIVE, "; measured again back to back, which did not run ok"
    again = compare(again_a, again_b, threshold)
    pair = f"{_range(again_a)} against {_range(again_b)}"
    if again != decided:
        return INCONCLUSIVE, f"; not reproduced back to back: {pair}"
    repeat = entry.get("repeat")  # the first case once more, after the pair
    if repeat is None:  # not run (an older recheck, or the pair agreed only at this threshold)
        return decided, f"; confirmed back to back: {pair}"
    if ok_rate(repeat) is None:
        return INCONCLUSIVE, f"; {pair} back to back, but the repeat did not run ok"
    if str(repeat.get("case_id")) == str(a.get("case_id")):
        third = compare(repeat, again_b, threshold)
    else:
        third = compare(again_a, repeat, threshold)
    pair += f", then {system_label(repeat.get('mode'))} again {_range(repeat)}"
    if third == decided:
        return decided, f"; confirmed back to back: {pair}"
    return INCONCLUSIVE, f"; not reproduced back to back: {pair}"


def _range(row) -> str:
    """``median [q1-q3]`` of a row, for the verdicts' reasons."""
    q1, q3 = _quartiles(row)
    return f"{ok_rate(row):.4g} [{q1:.4g}-{q3:.4g}]"


def hardware(rows) -> str:
    """Where rows were measured: ``"NVIDIA H200 x1 @host"`` / ``"cpu (x86_64) AMD EPYC, 2 ranks
    @host"`` (the CPU's model where the record names it), unique entries joined with ``; ``."""
    seen = []
    for row in rows:
        name = row.get("device_name")
        if name is None or (isinstance(name, float) and math.isnan(name)):
            continue
        count = _num(row.get("device_count")) or 0
        if not count and _present(row.get("cpu_model")):
            name = f"{name} {row['cpu_model']}"
        gpus = int(_num(row.get("gpus")) or 0)
        nodes = int(_num(row.get("nodes")) or 1)
        what = (f"{name}, {gpus} rank{'s' if gpus != 1 else ''}" if not count
                else f"{name} x{gpus}")
        if nodes > 1:
            what += f" on {nodes} nodes"
        host = row.get("hostname")
        if isinstance(host, str) and host:
            what += f" @{host}"
        if what not in seen:
            seen.append(what)
    return "; ".join(seen) or "unknown (no record ran)"


def verdict(points) -> str:
    """FAIL if any point fails, else INCONCLUSIVE if any is, else PASS if any passes."""
    verdicts = [p["verdict"] for p in points]
    for v in (FAIL, INCONCLUSIVE, PASS):
        if v in verdicts:
            return v
    return NOT_RUN


def counts(points) -> dict:
    return {v: sum(p["verdict"] == v for p in points) for v in VERDICTS}


def table_rows(df) -> list[dict]:
    """The rows of an aggregate table as dicts ([] for none)."""
    return [] if df is None or df.empty else df.to_dict("records")


def _groups(rows):
    groups = {}
    for row in rows:
        if row.get("mode") in BASELINES + SLAPO_SYSTEMS:
            groups.setdefault((row["model"], int(row["gpus"])), []).append(row)
    return groups


def _statuses(rows) -> dict:
    return {r["mode"]: r["status"] for r in rows}


BROKE = ("failed", "oom")  # a case that should have run and did not: a timeout is "failed"


def did_not_run(statuses: dict, modes, labels: dict, against: str) -> tuple[str, str]:
    """The verdict of a point where none of ``modes`` ran ok but ``against`` did: FAIL where one
    of them failed or ran out of memory (it could not do what the other did), NOT-RUN where
    each is unsupported or has no case. The reason names each one's status."""
    states = ", ".join(f"{labels[m]} {statuses[m]}" for m in modes if m in statuses)
    if any(statuses.get(m) in BROKE for m in modes):
        return FAIL, f"{states} where {against} ran ok"
    return NOT_RUN, f"{states or 'no case'}: nothing to compare with {against}"


def check_c1(e2e, rechecks: dict | None = None) -> dict:
    points = []
    for (model, gpus), rows in sorted(_groups(table_rows(e2e)).items()):
        by_mode = {r["mode"]: r for r in rows}
        rates = {r["mode"]: ok_rate(r) for r in rows}
        ran = {m: v for m, v in rates.items() if v is not None}
        statuses = _statuses(rows)
        numbers = {SYSTEM_LABELS[m]: (round(v, 4) if v is not None else statuses[m])
                   for m, v in rates.items()}
        slapo_ran = [m for m in SLAPO_SYSTEMS if m in ran]
        base_ran = [m for m in BASELINES if m in ran]
        compared = []
        if not ran:
            v, why = NOT_RUN, "no system ran ok"
        elif slapo_ran and not base_ran:
            v, why = PASS, "no baseline ran ok; Slapo did"
        elif slapo_ran:
            slapo = by_mode[max(slapo_ran, key=ran.get)]
            base = by_mode[max(base_ran, key=ran.get)]
            compared = [slapo["case_id"], base["case_id"]]
            single = compare(slapo, base)
            v, again = after_recheck(single, slapo, base, rechecks)
            relation = {PASS: "faster than", FAIL: "slower than",
                        INCONCLUSIVE: "within the noise of"}[single]
            why = (f"{SYSTEM_LABELS[slapo['mode']]} {_range(slapo)} {relation} "
                   f"{SYSTEM_LABELS[base['mode']]} {_range(base)}{again}")
        else:
            v, why = did_not_run(statuses, SLAPO_SYSTEMS, SYSTEM_LABELS, "a baseline")
        points.append({"model": model, "gpus": gpus, "verdict": v, "why": why,
                       "samples_per_s": numbers, "hardware": hardware(rows),
                       "compared": compared})
    return {"id": "C1", "title": TITLES["C1"], "verdict": verdict(points),
            "criterion": "the best Slapo system faster than the best baseline (noise rule)",
            "counts": counts(points), "points": points}


def c2_points(table, min_speedup: float, rechecks: dict | None = None) -> list[dict]:
    """C2's points of one aggregate table: per model and GPU count, the best Slapo system over
    the best baseline (noise rule at ``min_speedup``, and back to back where ``rechecks`` has
    the pair)."""
    points = []
    for (model, gpus), rows in sorted(_groups(table_rows(table)).items()):
        by_mode = {r["mode"]: r for r in rows}
        rates = {r["mode"]: ok_rate(r) for r in rows}
        slapo = {m: rates[m] for m in SLAPO_SYSTEMS if rates.get(m) is not None}
        base = {m: rates[m] for m in BASELINES if rates.get(m) is not None}
        nodes = max(int(_num(r.get("nodes")) or 1) for r in rows)
        point = {"model": model, "gpus": gpus, "nodes": nodes, "hardware": hardware(rows),
                 "on_cpu": not any(_num(r.get("device_count")) for r in rows),
                 "best_slapo": None, "best_baseline": None, "speedup": None}
        if slapo:
            best = by_mode[max(slapo, key=slapo.get)]
            point["best_slapo"] = {"system": system_label(best["mode"], _num(best.get("pp"))),
                                   "samples_per_s": slapo[best["mode"]]}
        if base:
            best = max(base, key=base.get)
            point["best_baseline"] = {"system": SYSTEM_LABELS[best],
                                      "samples_per_s": base[best]}
        if slapo and base:
            a, b = by_mode[max(slapo, key=slapo.get)], by_mode[max(base, key=base.get)]
            point["speedup"] = max(slapo.values()) / max(base.values())
            (a1, a3), (b1, b3) = _quartiles(a), _quartiles(b)
            point["speedup_range"] = [a1 / b3, a3 / b1]
            single = compare(a, b, min_speedup)
            point["verdict"], again = after_recheck(single, a, b, rechecks, min_speedup)
            relation = {PASS: ">=", FAIL: "<", INCONCLUSIVE: "within the noise of"}
            point["why"] = (f"{point['speedup']:.2f}x [{a1 / b3:.2f}-{a3 / b1:.2f}] "
                            f"{relation[single]} {min_speedup}x{again}")
        elif base:
            point["verdict"], point["why"] = did_not_run(
                _statuses(rows), SLAPO_SYSTEMS, SYSTEM_LABELS, "a baseline")
        else:
            point["verdict"] = NOT_RUN
            point["why"] = ("no system ran ok" if not slapo else
                            "no baseline ran ok (nothing to compare with)")
        points.append(point)
    return points


def c2_half(points, paper: float, none_why: str) -> dict:
    """One half of C2 from its points: the largest speedup measured beside the ``paper``'s,
    and its verdict ("up to": PASS if a point passes, else INCONCLUSIVE if one is, else FAIL
    if one fails, NOT-RUN without a comparable point: ``none_why``)."""
    measured = [p for p in points if p["speedup"] is not None]
    top = max(measured, key=lambda p: p["speedup"]) if measured else None
    verdicts = [p["verdict"] for p in points]
    half = {"paper": paper, "measured_max": top["speedup"] if top else None,
            "at": {"model": top["model"], "gpus": top["gpus"]} if top else None,
            "hardware": top["hardware"] if top else None,
            "on_cpu": top["on_cpu"] if top else None,
            "verdict": next((v for v in (PASS, INCONCLUSIVE, FAIL) if v in verdicts), NOT_RUN)}
    if not points:
        half["why"] = none_why
    elif not measured:
        half["why"] = "no point where a Slapo system and a baseline both ran ok"
    return half


def _reached(half: dict) -> str:
    """Whether a half of C2 measured at least the paper's speedup (a median ratio, reported;
    the verdict is against the bar)."""
    reached = "reached" if half["measured_max"] >= half["paper"] else "not reached"
    if half.get("on_cpu"):
        reached += " (measured on CPU ranks with a tiny model: not comparable with it)"
    return reached


def c2_half_brief(name: str, half: dict) -> str:
    """One half of C2 in a few words: its verdict, the largest speedup and whether the paper's
    was reached; a half without a measured speedup says why instead of a number."""
    if half["measured_max"] is None:
        return f"{name} {half['verdict']}: {half.get('why') or 'no data'}"
    return (f"{name} {half['verdict']}, largest {_fmt(half['measured_max'])}x: the paper's "
            f"{half['paper']}x {_reached(half)}")


def check_c2(e2e, min_speedup: float = DEFAULTS["c2_min_speedup"], multinode=None,
             rechecks: dict | None = None) -> dict:
    single_points = c2_points(e2e, min_speedup, rechecks)
    multi_points = c2_points(multinode, min_speedup, rechecks)
    single = c2_half(single_points, PAPER_C2["single_node"], "no one-node (e2e) case ran")
    multi = c2_half(multi_points, PAPER_C2["multi_node"],
                    "no multi-node cases in this profile; the profiles multinode and "
                    "cpu-multinode have them")
    points = single_points + multi_points
    return {"id": "C2", "title": TITLES["C2"], "verdict": verdict([single, multi]),
            "bar": min_speedup,
            "criterion": f"some point's speedup over the best baseline >= {min_speedup}x "
                         "(noise rule), on one node and on several; the largest is reported "
                         "beside the paper's, not required to match it",
            "single_node": single, "multi_node": multi, "counts": counts(points),
            "points": points}


def check_c3(loc, max_ratio: float = DEFAULTS["c3_max_ratio"]) -> dict:
    points = []
    for row in table_rows(loc):
        measured = _num(row.get("loc_artifact"))
        paper = int(row["paper_loc"])
        point = {"model": row["model"], "paper_loc": paper,
                 "loc_artifact": int(measured) if measured is not None else None,
                 "loc_statements": (int(_num(row.get("loc_statements")))
                                    if _num(row.get("loc_statements")) is not None else None),
                 "hardware": "n/a (static count)"}
        if measured is None:
            point["verdict"], point["why"] = NOT_RUN, (row.get("note") or "no schedule")
        else:
            ok = measured <= max_ratio * paper
            point["verdict"] = PASS if ok else FAIL
            point["why"] = (f"{int(measured)} {'<=' if ok else '>'} {max_ratio} x {paper}")
        points.append(point)
    return {"id": "C3", "title": TITLES["C3"], "verdict": verdict(points),
            "criterion": f"LoC by the artifact's rule <= {max_ratio} x the paper's. The rule "
                         "counts the lines of the family's schedule file and of the project "
                         "helpers it calls (Table 4's note names them), less those with `for`; "
                         "the library it calls (primitives, kernels) is not counted, as "
                         "upstream's was not. The paper gives its counts without a tolerance: "
                         f"the {max_ratio}x margin is this artifact's",
            "counts": counts(points), "points": points}


def check_c4(ablation, rechecks: dict | None = None) -> dict:
    rows = {r["mode"]: r for r in table_rows(ablation) if r.get("mode") in ABLATION_STEPS}
    points = []
    for prev, cur in zip(ABLATION_STEPS, ABLATION_STEPS[1:]):
        a, b = rows.get(prev), rows.get(cur)
        ra = ok_rate(a) if a else None
        rb = ok_rate(b) if b else None
        point = {"step": ABLATION_LABELS[cur], "previous": ABLATION_LABELS[prev],
                 "samples_per_s": {ABLATION_LABELS[prev]: ra if ra is not None else
                                   (a["status"] if a else "not in profile"),
                                   ABLATION_LABELS[cur]: rb if rb is not None else
                                   (b["status"] if b else "not in profile")},
                 "hardware": hardware([r for r in (a, b) if r])}
        if ra is not None and rb is None and b is not None:
            point["verdict"], point["why"] = did_not_run(
                {cur: b["status"]}, [cur], ABLATION_LABELS, ABLATION_LABELS[prev])
        elif ra is None or rb is None:
            point["verdict"], point["why"] = (
                NOT_RUN, "a step did not run ok (or is not in the profile)")
        else:
            point["ratio"] = rb / ra
            point["compared"] = [b.get("case_id"), a.get("case_id")]
            single = compare(b, a)
            point["verdict"], again = after_recheck(single, b, a, rechecks)
            relation = {PASS: ">", FAIL: "<", INCONCLUSIVE: "within the noise of"}
            point["why"] = (f"{_range(b)} {relation[single]} {_range(a)} samples/s "
                            f"({rb / ra:.2f}x){again}")
        points.append(point)
    return {"id": "C4", "title": TITLES["C4"], "verdict": verdict(points),
            "criterion": "each step faster than the previous one (noise rule)",
            "counts": counts(points), "points": points}


INCONCLUSIVE_MEANS = ("INCONCLUSIVE means the gap lies within the noise of the timed steps or "
                      "was not reproduced back to back, not that the claim failed.")
C3_ANYWHERE = "C3 counts lines of code: its verdict is the same on any machine."
ON_GPUS = ("For the paper's setting: on 8 GPUs or more `make reproduce` picks profile `paper`, "
           "Figures 7 and 9's own cases (on fewer, the cases that need more GPUs are recorded "
           "unsupported); 1 to 7 GPUs pick `gpu1`, real-size models that fit one GPU, smaller "
           "than Figure 7's; several nodes: profile `multinode` on Slurm (docs/workflow.md).")


def setting_note(frames) -> str:
    """What the verdicts show and do not show, given the hardware the data are from."""
    rows = [r for df in frames for r in table_rows(df)]
    if not rows:
        return ("No benchmark records: the throughput claims (C1, C2, C4) are NOT-RUN. "
                + C3_ANYWHERE)
    counts_ = {int(_num(r.get("device_count")) or 0) for r in rows if r.get("device_name")}
    names = sorted({str(r.get("device_name")) for r in rows if r.get("device_name")})
    if counts_ <= {0}:
        return ("Measured on CPU ranks (processes over gloo) with tiny models, which is not "
                "the paper's setting (full-size models on 8 x V100 32 GB, fp16). The verdicts "
                "show that the workflow measures and checks every claim end to end, not that "
                f"the paper's numbers reproduce. {INCONCLUSIVE_MEANS} {C3_ANYWHERE} "
                f"{ON_GPUS}")
    note = f"Measured on {', '.join(names)}."
    if any("V100" in n for n in names):
        note += (" The paper's GPU; newer baseline releases may beat the paper's baselines, "
                 "and the artifact expects the conclusions to hold, not the numbers.")
    else:
        note += (" The paper used 8 x V100 32 GB with fp16; other GPUs, GPU counts, dtypes and "
                 "newer baseline releases change the numbers, so the verdicts test the paper's "
                 "conclusions on this hardware, not its numbers.")
    return f"{note} {INCONCLUSIVE_MEANS} {C3_ANYWHERE}"


def _unique(rows, key) -> list:
    seen = []
    for row in rows:
        value = row.get(key)
        if _present(value) and value not in seen:
            seen.append(value)
    return seen


def _when(value) -> _dt.datetime | None:
    """A record's ISO 8601 time, None where it has none."""
    try:
        when = _dt.datetime.fromisoformat(str(value))
    except ValueError:
        return None
    return when if when.tzinfo else when.replace(tzinfo=_dt.UTC)


def run_seconds(row) -> float | None:
    """Wall seconds of the run behind an aggregate row (its record's start to its end), None
    where it has no times (a case that did not run)."""
    start, end = _when(row.get("started_at")), _when(row.get("finished_at"))
    return (end - start).total_seconds() if start and end else None


def run_facts(rows, recheck: dict | None = None) -> dict:
    """Where and when the records were measured, as they say themselves (each record's
    ``env`` and times): the commits, GPU and CPU models, cores and hosts, and the span from
    the first case's start to the last one's end, beside the recheck's own seconds (its
    reruns come after the cases)."""
    starts = [t for t in (_when(r.get("started_at")) for r in rows) if t]
    ends = [t for t in (_when(r.get("finished_at")) for r in rows) if t]
    first, last = (min(starts), max(ends)) if starts and ends else (None, None)
    gpu_rows = [r for r in rows if (_num(r.get("device_count")) or 0) > 0]
    return {
        "records": len(rows),
        "commits": [str(c) for c in _unique(rows, "git_commit")],
        "gpu_models": [str(n) for n in _unique(gpu_rows, "device_name")],
        "max_gpus": max((int(_num(r.get("gpus")) or 0) for r in rows), default=0),
        "cpu_models": [str(m) for m in _unique(rows, "cpu_model")],
        "cpu_counts": sorted({int(_num(c)) for c in _unique(rows, "cpu_count") if _num(c)}),
        "hosts": [str(h) for h in _unique(rows, "hostname")],
        "first_start": first.isoformat(timespec="seconds") if first else None,
        "last_finish": last.isoformat(timespec="seconds") if last else None,
        "cases_wall_s": round((last - first).total_seconds(), 1) if first else None,
        "recheck_s": (recheck or {}).get("seconds"),
        "packages": {name: [str(v) for v in _unique(rows, key)] for name, key in PACKAGES},
    }


# The packages a record names (aggregate columns), as the setting line names them.
PACKAGES = (("torch", "torch"), ("transformers", "transformers"), ("DeepSpeed", "deepspeed"),
            ("megatron-core", "megatron_core"))


def _packages(facts) -> str:
    """", with torch 2.13.0, ..." as the records name them ("" where they name none)."""
    found = [f"{name} {' / '.join(versions)}"
             for name, versions in facts.get("packages", {}).items() if versions]
    return f", with {', '.join(found)}" if found else ""


def _commit(facts) -> str:
    short = [c[:12] + ("+dirty" if c.endswith("+dirty") else "") for c in facts["commits"]]
    if not short:
        return "commit unknown (the records name none)"
    if len(short) == 1:
        return f"commit {short[0]}"
    return f"commits {', '.join(short)} (the records come from more than one)"


def _machine(facts) -> str:
    cpu = " / ".join(facts["cpu_models"]) or "a CPU of unknown model"
    cores = facts["cpu_counts"]
    if cores:
        cpu += f", {' / '.join(map(str, cores))} core{'s' if cores != [1] else ''}"
    hosts = f" @{', '.join(facts['hosts'])}" if facts["hosts"] else ""
    if facts["gpu_models"]:
        return (f"{' / '.join(facts['gpu_models'])} GPUs (up to {facts['max_gpus']} a case; "
                f"host CPU {cpu}){hosts}")
    return f"CPU ranks over gloo, no GPU ({cpu}){hosts}"


def _span(facts) -> str:
    if facts["cases_wall_s"] is None:
        return "the records give no times"
    first, last = (_when(facts[k]) for k in ("first_start", "last_finish"))
    end = (f"{last:%H:%M}" if first.date() == last.date() else f"{last:%Y-%m-%d %H:%M}")
    text = (f"the cases ran {first:%Y-%m-%d %H:%M}-{end} UTC, "
            f"{facts['cases_wall_s'] / 60:.1f} min wall")
    if facts["recheck_s"] is not None:
        text += f", then the back-to-back recheck {facts['recheck_s']:.0f} s"
    return text


def setting_line(profile, facts) -> str:
    """The report's first line: profile, commit, hardware, when and how long."""
    if not facts["records"]:
        return f"{profile or 'no'} profile; no benchmark records."
    return (f"{profile} profile, {_commit(facts)}, on {_machine(facts)}{_packages(facts)}; "
            f"{_span(facts)}.")


def _tally(n: dict) -> str:
    total = sum(n.values())
    if not total:
        return "no data points"
    return (", ".join(f"{n[v]} {v}" for v in VERDICTS if n[v])
            + f" of {total} point{'s' if total != 1 else ''}")


def verdicts_line(checked) -> str:
    """The report's second line: each claim's verdict with its points, C2's with its bar and
    whether the paper's speedups were reached."""
    parts = []
    for c in checked:
        if c["id"] == "C2":
            halves = "; ".join(c2_half_brief(name, c[key]) for name, key in
                               (("one node", "single_node"), ("several nodes", "multi_node")))
            parts.append(f"C2 {c['verdict']} (bar: speedup >= {c['bar']}x beyond the noise; "
                         f"{halves})")
        else:
            parts.append(f"{c['id']} {c['verdict']} ({_tally(c['counts'])})")
    return "; ".join(parts) + "."


def check_all(e2e, ablation, loc, options: dict | None = None, gaps: dict | None = None,
              multinode=None, recheck: dict | None = None) -> dict:
    """Every claim; ``gaps``: :mod:`slapo_ae.analysis.gaps`' result, reported after the
    claims; ``multinode``: Figure 8's table (C2's multi-node half); ``recheck``:
    :mod:`slapo_ae.analysis.recheck`'s, the comparisons measured again back to back."""
    opts = {**DEFAULTS, **(options or {})}
    frames = (e2e, ablation, multinode)
    profiles = sorted({str(p) for df in frames for p in
                       (df["profile"].dropna().unique() if df is not None and not df.empty
                        else [])})
    rows = [r for df in frames for r in table_rows(df)]
    rechecks = (recheck or {}).get("comparisons")
    profile = ", ".join(profiles) or None
    facts = run_facts(rows, recheck)
    checked = [check_c1(e2e, rechecks),
               check_c2(e2e, opts["c2_min_speedup"], multinode, rechecks),
               check_c3(loc, opts["c3_max_ratio"]), check_c4(ablation, rechecks)]
    setting = setting_note(list(frames))
    return {
        "generated_at": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "profile": profile,
        "summary": {"setting": setting_line(profile, facts), "verdicts": verdicts_line(checked),
                    "shows": setting},
        "run": facts,
        "setting": setting,
        "hardware": hardware(rows),
        "options": opts,
        "recheck": {key: value for key, value in (recheck or {}).items()
                    if key != "comparisons"} or None,
        "claims": checked,
        "engines": gaps,
    }


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        if value.keys() == {"system", "samples_per_s"}:  # C2's best of each side
            return f"{value['system']} {_fmt(value['samples_per_s'])}"
        return ", ".join(f"{k}: {_fmt(v)}" for k, v in value.items())
    return str(value)


# The table of each claim's points in claims.md: (column header, point key, right-aligned).
CLAIM_COLUMNS = {
    "C1": [("model", "model", False), ("GPUs", "gpus", True), ("verdict", "verdict", False),
           ("why", "why", False), ("samples/s", "samples_per_s", False),
           ("hardware", "hardware", False)],
    "C2": [("model", "model", False), ("GPUs", "gpus", True), ("nodes", "nodes", True),
           ("verdict", "verdict", False), ("why", "why", False),
           ("best Slapo (samples/s)", "best_slapo", False),
           ("best baseline (samples/s)", "best_baseline", False),
           ("hardware", "hardware", False)],
    "C3": [("model", "model", False), ("verdict", "verdict", False),
           ("LoC (artifact rule)", "loc_artifact", True), ("paper", "paper_loc", True),
           ("statements", "loc_statements", True), ("why", "why", False)],
    "C4": [("step", "step", False), ("over", "previous", False), ("verdict", "verdict", False),
           ("why", "why", False), ("samples/s", "samples_per_s", False),
           ("hardware", "hardware", False)],
}


def _table(columns, points) -> list[str]:
    rows = ["| " + " | ".join(header for header, _, _ in columns) + " |",
            "|" + "|".join("---:" if right else "---" for _, _, right in columns) + "|"]
    rows += ["| " + " | ".join(_fmt(p[key]) for _, key, _ in columns) + " |" for p in points]
    return rows


def _bar(c: dict, options: dict) -> str:
    """What a claim's points had to show, for the summary table (C2: with its halves)."""
    if c["id"] == "C2":
        halves = "; ".join(c2_half_brief(name, c[key]) for name, key in
                           (("one node", "single_node"), ("several nodes", "multi_node")))
        return f"speedup >= {c['bar']}x over the best baseline; {halves}"
    return {"C1": "the best Slapo system faster than the best baseline",
            "C3": f"lines of code <= {options['c3_max_ratio']} x the paper's",
            "C4": "each step faster than the one before"}[c["id"]]


def to_markdown(result: dict) -> str:
    summary = result["summary"]
    lines = ["# Claims of the Slapo paper, checked", "",
             f"- **Setting:** {summary['setting']}",
             f"- **Verdicts:** {summary['verdicts']}",
             f"- **What they show:** {summary['shows']}", "",
             f"Generated {result['generated_at']} from the aggregates of the records. "
             "The claims come first; the artifact's own check of Slapo beside its own engine "
             "follows them.", "",
             f"**Noise rule.** {NOISE_RULE}", ""]
    again = result.get("recheck")
    if again:
        lines += [f"**Back to back.** {BACK_TO_BACK_RULE.format(below=again['below'])} "
                  f"{again['measured']} comparison(s) measured again here "
                  f"({again.get('repeated', 0)} with a repeat), with {again['steps']} steps "
                  f"({again['warmup']} warm-up) each"
                  + (f"; {len(again['not_measured'])} more close one(s), past the "
                     "limit, were not and are marked so" if again.get("not_measured")
                     else "") + ".", ""]
    lines += ["| claim | verdict | points (PASS / FAIL / INCONCLUSIVE / NOT-RUN) | bar |",
              "|---|---|---|---|"]
    for c in result["claims"]:
        n = c["counts"]
        lines.append(f"| {c['id']} | **{c['verdict']}** | {n[PASS]} / {n[FAIL]} / "
                     f"{n[INCONCLUSIVE]} / {n[NOT_RUN]} | {_bar(c, result['options'])} |")
    for c in result["claims"]:
        bar = f" (bar: speedup >= {c['bar']}x)" if c["id"] == "C2" else ""
        lines += ["", f"## {c['id']}: {c['verdict']}{bar}", "", c["title"], ""]
        if "criterion" in c:
            lines += [f"Criterion: {c['criterion']}.", ""]
        if c["id"] == "C2":
            lines += [_c2_half_line("One node", c["single_node"], c["bar"]),
                      _c2_half_line("Several nodes (up to 64 GPUs)", c["multi_node"], c["bar"]),
                      ""]
        if not c["points"]:
            lines.append("No data points: NOT-RUN.")
            continue
        lines += _table(CLAIM_COLUMNS[c["id"]], c["points"])
    lines += _engines_section(result.get("engines"))
    return "\n".join(lines) + "\n"


def _c2_half_line(what: str, half: dict, bar: float) -> str:
    """One half of C2 in claims.md: its verdict against the bar, the largest speedup measured
    and whether it reached the paper's."""
    if half["measured_max"] is None:
        return f"- {what}: **{half['verdict']}**: {half['why']} (the paper: {half['paper']}x)."
    at = f"{half['at']['model']}, {half['at']['gpus']} GPUs"
    return (f"- {what}: **{half['verdict']}** against the bar of {bar}x; the largest speedup "
            f"{_fmt(half['measured_max'])}x ({at}, on {half['hardware'] or '-'}): the "
            f"paper's {half['paper']}x {_reached(half)}.")


ENGINE_COLUMNS = [("point", "what", False), ("model", "model", False), ("GPUs", "gpus", True),
                  ("ratio", "ratio", True), ("Slapo is", "relation", False),
                  ("back to back", "back_to_back", False),
                  ("cause (where Slapo is behind)", "cause", False)]


def _engines_section(gaps: dict | None) -> list[str]:
    """Slapo beside its own engine (not a paper claim): each Slapo system against the
    baseline whose engine it runs on, each ablation step against the one before; where Slapo
    is behind, the cause from the profile of both (slapo_ae.analysis.gaps)."""
    lines = ["", "## The artifact's own check: Slapo beside its own engine", "",
             "Not a claim of the paper. A Slapo system is its baseline's engine plus a "
             "schedule (Slapo-TP: a Megatron-style loop; Slapo-ZeRO3: DeepSpeed), and each "
             "ablation step adds to the one before, so none should be slower. Each point is "
             "judged with the noise rule and, for close calls, back to back. Where Slapo is "
             "still behind, both cases were profiled again (torch.profiler, rank 0's operators' "
             "self time: their kernels' on a GPU, CPU time on CPU); the cause is where their "
             "time differs.", ""]
    if not gaps or not gaps.get("points"):
        return lines + ["No point where both sides ran ok."]
    points = [{**p, "cause": p.get("cause", ""), "back_to_back": p.get("back_to_back", "")}
              for p in gaps["points"]]
    return lines + _table(ENGINE_COLUMNS, points)


def read_table(path):
    """An aggregate CSV as a DataFrame; None when it is missing or empty."""
    import pandas as pd

    if path is None or not Path(path).is_file():
        return None
    try:
        return pd.read_csv(path)
    except pd.errors.EmptyDataError:
        return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Check claims C1-C4 on the aggregates.")
    parser.add_argument("--e2e")
    parser.add_argument("--ablation")
    parser.add_argument("--multinode", help="Figure 8's CSV: C2's multi-node half")
    parser.add_argument("--loc")
    parser.add_argument("--md", required=True)
    parser.add_argument("--json", required=True)
    parser.add_argument("--c2-min-speedup", type=float, default=DEFAULTS["c2_min_speedup"])
    parser.add_argument("--c3-max-ratio", type=float, default=DEFAULTS["c3_max_ratio"])
    parser.add_argument("--gaps", help="slapo_ae.analysis.gaps' JSON: Slapo beside its own engine")
    parser.add_argument("--recheck", help="slapo_ae.analysis.recheck's JSON: comparisons "
                                          "measured again back to back")
    args = parser.parse_args(argv)
    gaps, recheck = (json.loads(Path(path).read_text()) if path and Path(path).is_file()
                     else None for path in (args.gaps, args.recheck))
    result = check_all(read_table(args.e2e), read_table(args.ablation), read_table(args.loc),
                       {"c2_min_speedup": args.c2_min_speedup, "c3_max_ratio": args.c3_max_ratio},
                       gaps, read_table(args.multinode), recheck)
    from slapo_ae.atomic import write_text

    write_text(args.json, json.dumps(result, indent=2, default=str) + "\n")
    text = to_markdown(result)
    write_text(args.md, text)
    for c in result["claims"]:
        n = c["counts"]
        print(f"{c['id']}: {c['verdict']} ({n[PASS]} pass, {n[FAIL]} fail, "
              f"{n[INCONCLUSIVE]} inconclusive, {n[NOT_RUN]} not run)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
