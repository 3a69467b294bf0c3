"""Benchmark: each Slapo system beside its own engine, and each ablation step beside the one
before, on CPU ranks, interleaved (printed).

    python benchmarks/bench_pairs.py [--rounds 3] [--steps S] [--warmup W] [--cores N]
                                     [--pairs megatron,deepspeed,ablation] [--models bert-tiny]
                                     [--control]
                                     [--json out.json]

Pairs, from the cpu profile's cfg files (configs/e2e/cpu_tiny.cfg,
configs/ablation/cpu_tiny.cfg): ``megatron`` vs ``slapo-megatron`` (models megatron-core has)
and ``deepspeed`` vs ``slapo-deepspeed``, per model of ``--models`` and rank count, and each
ablation step vs the one before. Each round runs both sides of every pair back to back,
alternating which goes first, so that whatever else loads the machine loads both alike.
Printed per pair: the median over the rounds of each run's median samples/s, the range of those
medians, the ratio (Slapo / engine, later step / earlier) with its range over the rounds and the
rounds in which it was at least 1; and the load. Steps and warm-up default to the cpu profile's.

``--control`` also runs each pair's first case a second time every round (an A/A pair: the same
case against itself) and prints that ratio beside the pair's: what this machine's noise alone
does to a ratio in the same session, the band a pair's ratio must leave to show a difference
(docs/workflow.md: on gpt-neo-tiny at 2 ranks, 2026-12-03).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import yaml
from harness_runs import ROOT, case_label, fmt, load, rate, run_by_hand, summary

ENGINES = {"megatron": "slapo-megatron", "deepspeed": "slapo-deepspeed"}
E2E_CFG = ROOT / "configs" / "e2e" / "cpu_tiny.cfg"
ABLATION_CFG = ROOT / "configs" / "ablation" / "cpu_tiny.cfg"
CPU_PROFILE = yaml.safe_load((ROOT / "configs" / "config.yaml").read_text())["profiles"]["cpu"]


def pairs(kinds, models) -> list[tuple]:
    from slapo_ae.cfg import parse_cfg
    from slapo_ae.harness.systems.support import MEGATRON_FAMILIES
    from slapo_ae.zoo.configs import model_family

    found = []
    cases = {(c.mode, c.model, c.gpus): c for c in parse_cfg(E2E_CFG, max_gpus=2)}
    for (mode, model, gpus), case in cases.items():
        ours = cases.get((ENGINES.get(mode), model, gpus))
        if mode not in kinds or model not in models or ours is None:
            continue
        if mode == "megatron" and model_family(model) not in MEGATRON_FAMILIES:
            continue  # unsupported, as in the paper: nothing to compare
        found.append((case, ours))
    if "ablation" in kinds:
        steps = parse_cfg(ABLATION_CFG, max_gpus=2)
        found += list(zip(steps, steps[1:]))
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=CPU_PROFILE["steps"])
    parser.add_argument("--warmup", type=int, default=CPU_PROFILE["warmup"])
    parser.add_argument("--cores", type=int, default=None,
                        help="cores per case (default: the harness's, one per rank)")
    parser.add_argument("--pairs", default="megatron,deepspeed,ablation")
    parser.add_argument("--models", default="bert-tiny")
    parser.add_argument("--control", action="store_true",
                        help="also run each pair's first case against itself (A/A)")
    parser.add_argument("--json", help="also write the numbers here")
    args = parser.parse_args(argv)
    todo = pairs(args.pairs.split(","), args.models.split(","))
    sides = (0, 1, 2) if args.control else (0, 1)  # 2: the first case again
    rates = {i: ([], [], []) for i in range(len(todo))}
    print(f"{len(todo)} pairs x {args.rounds} rounds, {args.steps} steps ({args.warmup} warm-up); "
          f"{load()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_pairs_") as tmp:
        for r in range(args.rounds):
            for i, pair in enumerate(todo):
                order = sides if (r + i) % 2 == 0 else sides[::-1]
                for side in order:
                    case = pair[0 if side == 2 else side]  # the control: the first case again
                    record = run_by_hand(case, Path(tmp) / f"{i}-{side}.json", args.steps,
                                         args.warmup, args.cores)
                    value = rate(record)
                    if value is None:
                        raise SystemExit(f"{case_label(case)}: {record['status']}: "
                                         f"{record['reason'][:500]}")
                    rates[i][side].append(value)
            print(f"round {r + 1}/{args.rounds} done; {load()}", flush=True)
    rows = []
    print(f"\n{'engine or earlier step':34s} {'samples/s [range]':>22s}   "
          f"{'Slapo or later step':34s} {'samples/s [range]':>22s}   ratio [range] rounds >= 1"
          + ("   A/A ratio [range]" if args.control else ""))
    for i, (a, b) in enumerate(todo):
        ra, rb, again = rates[i]
        ratios = [y / x for x, y in zip(ra, rb)]
        row = {"a": case_label(a), "b": case_label(b), "a_stats": summary(ra),
               "b_stats": summary(rb), "ratio": statistics.median(ratios),
               "ratio_min": min(ratios), "ratio_max": max(ratios), "ratios": ratios,
               "rounds_at_least_1": sum(r >= 1 for r in ratios)}
        line = (f"{row['a']:34s} {fmt(row['a_stats']):>22s}   {row['b']:34s} "
                f"{fmt(row['b_stats']):>22s}   {row['ratio']:.2f} "
                f"[{row['ratio_min']:.2f}-{row['ratio_max']:.2f}] "
                f"{row['rounds_at_least_1']}/{len(ratios)}")
        if again:
            controls = [y / x for x, y in zip(ra, again)]
            row.update(control_ratio=statistics.median(controls), control_ratios=controls)
            line += f"   {row['control_ratio']:.2f} [{min(controls):.2f}-{max(controls):.2f}]"
        rows.append(row)
        print(line)
    print(f"\nafter: {load()}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "rounds": args.rounds,
                                               "steps": args.steps, "warmup": args.warmup},
                                              indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
