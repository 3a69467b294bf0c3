"""Slapo beside its own engine: where a Slapo system trails, profile both and say where the time
goes (``results/gaps.json``, read by :mod:`slapo_ae.analysis.claims`).

A Slapo system is its baseline's engine plus a schedule, so it should never be slower:

- ``slapo-megatron`` >= ``megatron`` and ``slapo-deepspeed`` >= ``deepspeed``, per model and GPU
  count (where both ran ``ok``);
- each Figure 9 step >= the step before it.

Each such point is judged with the claims' noise rule (:func:`slapo_ae.analysis.claims.compare`):
``ahead`` (PASS), ``behind`` (FAIL) or ``within the noise`` (INCONCLUSIVE), and, where it was
measured again back to back (``--recheck``, :mod:`slapo_ae.analysis.recheck`), it stays
decided only if that pair agrees. For every point
behind (at most ``--max-profiles``, the largest gaps first) both cases run again for a few
steps under torch.profiler (``slapo-bench run --profile``), and rank 0's per-step self time
of each operator is compared (on a GPU the time of the kernels it launched, which is where a
GPU's step goes; on CPU its CPU time): in all, in collectives (and their waits), per
operator, the operators whose time differs most first, and in matrix products: their work
(GFLOP, from their shapes) and rate, which tell more matmul work from the same work done
slower. The profiles' tables and traces stay under ``--profiles``.

    python -m slapo_ae.analysis.gaps --e2e results/e2e.csv --ablation results/ablation.csv \\
        --out results/gaps.json --profiles results/profiles [--harness CMD]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from slapo_ae.analysis.aggregate import ABLATION_LABELS, ABLATION_STEPS, SYSTEM_LABELS
from slapo_ae.analysis.claims import (
    FAIL,
    INCONCLUSIVE,
    PASS,
    after_recheck,
    compare,
    ok_rate,
    read_table,
    table_rows,
)
from slapo_ae.analysis.rerun import case_fields, run_again
from slapo_ae.atomic import write_text
from slapo_ae.harness.profiling import COLLECTIVE
from slapo_ae.harness.runner import DEFAULT_HARNESS

ENGINE_PAIRS = (("megatron", "slapo-megatron"), ("deepspeed", "slapo-deepspeed"))
RELATION = {PASS: "ahead", FAIL: "behind", INCONCLUSIVE: "within the noise"}
NOT_REPRODUCED = "within the noise between runs"  # decided, but not so back to back
PROFILE_STEPS, PROFILE_WARMUP = 10, 3
MAX_PROFILES = 6
TOP_DIFFERENCES = 6
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def _ok(row) -> bool:
    return row is not None and (ok_rate(row) or 0) > 0


def _label(mode: str) -> str:
    return SYSTEM_LABELS.get(mode) or ABLATION_LABELS.get(mode) or mode


def target_points(e2e_rows, ablation_rows, rechecks: dict | None = None) -> list[dict]:
    """Every point of the targets where both sides ran ok, with its verdict (after the
    back-to-back re-measurement, where ``rechecks`` has one)."""
    points = []
    by_case = {(r["mode"], r["model"], int(r["gpus"])): r for r in e2e_rows}
    for engine, slapo in ENGINE_PAIRS:
        for (mode, model, gpus), base in sorted(by_case.items()):
            ours = by_case.get((slapo, model, gpus))
            if mode == engine and _ok(base) and _ok(ours):
                points.append(_point(f"{_label(slapo)} vs {_label(engine)}", model, gpus,
                                     base, ours, rechecks))
    steps = {r["mode"]: r for r in ablation_rows}
    for before, after in zip(ABLATION_STEPS, ABLATION_STEPS[1:]):
        if _ok(steps.get(before)) and _ok(steps.get(after)):
            a, b = steps[before], steps[after]
            points.append(_point(f"{_label(after)} vs {_label(before)}", b["model"],
                                 int(b["gpus"]), a, b, rechecks))
    return points


def _point(what, model, gpus, base, ours, rechecks=None) -> dict:
    single = compare(ours, base)
    verdict, again = after_recheck(single, ours, base, rechecks)
    relation = RELATION[verdict] if verdict == single else NOT_REPRODUCED
    point = {"what": what, "model": model, "gpus": gpus, "verdict": verdict,
             "relation": relation,
             "ratio": float(ours["samples_per_s"]) / float(base["samples_per_s"]),
             "baseline": case_fields(base), "slapo": case_fields(ours)}
    if again:
        point["back_to_back"] = again.removeprefix("; ")
    return point


def profile_case(case: dict, out_dir: Path, device: str, dtype: str,
                 harness: str = DEFAULT_HARNESS, timeout: float | None = None) -> dict:
    """Run ``case`` (:func:`slapo_ae.analysis.rerun.case_fields`) under the profiler through
    the harness CLI; returns rank 0's operators (``rank0.ops.json``)."""
    record = run_again(case, out_dir, PROFILE_STEPS, PROFILE_WARMUP, device, dtype, harness,
                       ("--profile", str(out_dir)), timeout=timeout)
    if record is None or record.status != "ok":
        log = out_dir / "run.log"
        what = (record.reason.splitlines()[0] if record and record.reason else
                f"no record; see {log}")
        raise RuntimeError(f"profiling {case['mode']} {case['model']}: {what}")
    return json.loads((out_dir / "rank0.ops.json").read_text())


def clock(ops: dict) -> str:
    """Which self time a profile's operators are compared by: ``"device"`` (their kernels'
    time) where the profile has it, on CUDA, else ``"cpu"``."""
    return "device" if any("self_device_us" in op for op in ops["ops"].values()) else "cpu"


def per_step(ops: dict) -> dict[str, float]:
    """Self milliseconds per profiled step, per operator, by the profile's :func:`clock`."""
    steps, key = max(ops["steps"], 1), f"self_{clock(ops)}_us"
    return {name: op.get(key, 0.0) / 1e3 / steps for name, op in ops["ops"].items()}


def matmul_work(ops: dict) -> tuple[float, float] | None:
    """(GFLOP, self ms by the profile's :func:`clock`) per profiled step of the matrix
    products; None for a profile without FLOPs. (torch.profiler also counts element-wise
    FLOPs, and a convolution's at its outer op, whose self time is not the kernel's: neither
    is a rate to compare.)"""
    counted = [op for name, op in ops["ops"].items() if name in MATMUL_OPS and op.get("flops")]
    if not counted:
        return None
    steps, key = max(ops["steps"], 1), f"self_{clock(ops)}_us"
    return (sum(op["flops"] for op in counted) / 1e9 / steps,
            sum(op.get(key, 0.0) for op in counted) / 1e3 / steps)


def explain(base_ops: dict, slapo_ops: dict, batches: tuple[int, int] = (1, 1)) -> dict:
    """Where the time per step goes, baseline against Slapo (rank 0, self ms by the
    profiles' :func:`clock`);
    ``batches``: the two cases' global batches, which differ where an ablation step adds
    ranks (Figure 9: + Kernel Opt on 1 rank, batch 8; + Attn/FFN TP on 2, batch 16)."""
    a, b = per_step(base_ops), per_step(slapo_ops)
    collective = lambda ops: sum(v for k, v in ops.items() if COLLECTIVE.search(k))  # noqa: E731
    diffs = sorted(((name, a.get(name, 0.0), b.get(name, 0.0)) for name in set(a) | set(b)),
                   key=lambda t: abs(t[2] - t[1]), reverse=True)
    wall = [base_ops["wall_us"] / 1e3 / max(base_ops["steps"], 1),
            slapo_ops["wall_us"] / 1e3 / max(slapo_ops["steps"], 1)]
    return {
        "wall_ms_per_step": wall, "batches": list(batches),
        "wall_ms_per_sample": [wall[0] / batches[0], wall[1] / batches[1]],
        "clock": clock(base_ops),
        "self_ms_per_step": [sum(a.values()), sum(b.values())],
        "collective_ms_per_step": [collective(a), collective(b)],
        "largest_differences": [{"op": name, "baseline_ms": x, "slapo_ms": y}
                                for name, x, y in diffs[:TOP_DIFFERENCES]],
        **_matmul_fields(base_ops, slapo_ops),
    }


def _matmul_fields(base_ops: dict, slapo_ops: dict) -> dict:
    work = [matmul_work(base_ops), matmul_work(slapo_ops)]
    if None in work:
        return {}
    return {"matmul_gflop_per_step": [w[0] for w in work],
            "matmul_ms_per_step": [w[1] for w in work]}


def cause_text(profile: dict) -> str:
    """One line: the profile's totals and its largest per-operator differences, and whether
    the profiled run reproduced the gap at all. One that does not is not shown to be noise:
    on t5-tiny, 2 ranks, three unprofiled pairs had Slapo-TP behind Megatron-LM (0.70 to 0.87)
    and both profiled pairs right after had Slapo's step the shorter (docs/workflow.md)."""
    wa, wb = profile["wall_ms_per_step"]
    sa, sb = profile["wall_ms_per_sample"]
    ca, cb = profile["collective_ms_per_step"]
    ops = ", ".join(f"{d['op']} {d['baseline_ms']:.1f} -> {d['slapo_ms']:.1f}"
                    for d in profile["largest_differences"])
    batches = profile["batches"]
    per_sample = (f" ({sa:.1f} -> {sb:.1f} ms a sample, batches {batches[0]} and {batches[1]})"
                  if batches[0] != batches[1] else "")
    matmul = ""
    if "matmul_gflop_per_step" in profile:
        (fa, fb), (ma, mb) = profile["matmul_gflop_per_step"], profile["matmul_ms_per_step"]
        rate = lambda f, ms: f"{1e3 * f / ms:.1f}" if ms else "-"  # noqa: E731
        # a step that adds ranks should shrink each rank's work a sample; replicated work does not
        work_a_sample = (f", {1e3 * fa / batches[0]:.0f} -> {1e3 * fb / batches[1]:.0f} "
                         f"MFLOP a sample" if batches[0] != batches[1] else "")
        matmul = (f"; matrix products {fa:.2f} -> {fb:.2f} GFLOP{work_a_sample} in {ma:.1f} -> "
                  f"{mb:.1f} ms ({rate(fa, ma)} -> {rate(fb, mb)} GFLOP/s)")
    verdict = ("gap not reproduced when profiled: Slapo took the shorter time a sample, so the "
               "profile does not show a cause; " if sb <= sa else "")
    return (f"{verdict}profiled step (rank 0): {wa:.1f} -> {wb:.1f} ms wall{per_sample}, "
            f"collectives {ca:.1f} -> {cb:.1f} ms{matmul}; largest differences (self "
            f"{profile.get('clock', 'cpu').upper()} ms/step, baseline -> Slapo): {ops}")


def find_gaps(e2e_rows, ablation_rows, profiles: Path | None, device: str = "cpu",
              dtype: str = "fp32", max_profiles: int = MAX_PROFILES,
              harness: str = DEFAULT_HARNESS, rechecks: dict | None = None,
              timeout: float | None = None) -> dict:
    points = target_points(e2e_rows, ablation_rows, rechecks)
    behind = sorted((p for p in points if p["verdict"] == FAIL), key=lambda p: p["ratio"])
    for i, point in enumerate(behind):
        if profiles is None or i >= max_profiles:
            point["cause"] = "not profiled" + (
                "" if profiles is None else " (the profile reruns no case: reruns: false)"
                if max_profiles == 0 else f" (only the {max_profiles} largest gaps are)")
            continue
        where = profiles / f"{point['slapo']['mode']}__{point['model'].replace('/', '_')}__" \
                           f"g{point['gpus']}"
        try:
            base = profile_case(point["baseline"], where / "baseline", device, dtype, harness,
                                timeout)
            ours = profile_case(point["slapo"], where / "slapo", device, dtype, harness, timeout)
        except (RuntimeError, OSError, ValueError) as err:
            point["cause"] = f"profiling failed: {err}"
            continue
        point["profile"] = explain(base, ours, (point["baseline"]["batch_size"],
                                                point["slapo"]["batch_size"]))
        point["profile_dir"] = str(where)
        point["cause"] = cause_text(point["profile"])
    return {"points": points, "behind": len(behind), "device": device,
            "profile_steps": PROFILE_STEPS - PROFILE_WARMUP}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--e2e")
    parser.add_argument("--ablation")
    parser.add_argument("--out", required=True)
    parser.add_argument("--profiles", required=True, help="folder of the profiles")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "fp16", "bf16"))
    parser.add_argument("--max-profiles", type=int, default=MAX_PROFILES)
    parser.add_argument("--harness", default=DEFAULT_HARNESS, help="the harness CLI")
    parser.add_argument("--recheck", help="slapo_ae.analysis.recheck's JSON: comparisons "
                                          "measured again back to back")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds for each profiled run (default: the harness's)")
    args = parser.parse_args(argv)
    recheck = (json.loads(Path(args.recheck).read_text())
               if args.recheck and Path(args.recheck).is_file() else {})
    result = find_gaps(table_rows(read_table(args.e2e)), table_rows(read_table(args.ablation)),
                       Path(args.profiles), args.device, args.dtype, args.max_profiles,
                       args.harness, recheck.get("comparisons"), args.timeout)
    write_text(args.out, json.dumps(result, indent=2) + "\n")
    for p in result["points"]:
        print(f"{p['what']} {p['model']} x{p['gpus']}: {p['ratio']:.2f}x, {p['relation']}"
              + (f"; {p['cause']}" if p.get("cause") else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
