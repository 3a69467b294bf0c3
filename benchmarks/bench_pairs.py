"""Benchmark: each Slapo system beside its own engine, and each ablation step beside the one
before, on CPU ranks, interleaved (printed).

    python benchmarks/bench_pairs.py [--rounds 3] [--steps 25] [--warmup 5] [--cores N]
                                     [--pairs megatron,deepspeed,ablation] [--models bert-tiny]
                                     [--json out.json]

Pairs: ``megatron`` vs ``slapo-megatron`` and ``deepspeed`` vs ``slapo-deepspeed`` (per model,
1 and 2 ranks, batch 4 x ranks, seq 128 as in the cpu profile), and the ablation's steps
(Vanilla vs + Kernel Opt on 1 rank, batch 8; + Attn/FFN TP vs + Embedding TP on 2 ranks, batch
16). Each round runs both sides of every pair back to back, alternating which goes first, so
that whatever else loads the machine loads both alike. Printed per pair: the median over the
rounds of each run's median samples/s, the range of those medians, and the ratio
(Slapo / engine, later step / earlier) with its range over the rounds; and the load.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from harness_runs import case_label, fmt, load, rate, run_by_hand, summary

# The cpu profile's shapes (configs/e2e/cpu_tiny.cfg, configs/ablation/cpu_tiny.cfg).
SEQ = {"t5-tiny": (128, 64), "wideresnet-tiny": (1, 0)}
MEGATRON_MODELS = ("bert-tiny", "gpt-neo-tiny", "t5-tiny", "llama-tiny")


def pairs(kinds, models) -> list[tuple]:
    found = []
    for kind in kinds:
        if kind == "ablation":
            found.append((("eager", "bert-tiny", 1, 128, 0, 8),
                          ("slapo-kernel", "bert-tiny", 1, 128, 0, 8)))
            found.append((("slapo-tp-attn-ffn", "bert-tiny", 2, 128, 0, 16),
                          ("slapo-tp-full", "bert-tiny", 2, 128, 0, 16)))
            continue
        for model in models:
            if kind == "megatron" and model not in MEGATRON_MODELS:
                continue
            seq, dec = SEQ.get(model, (128, 0))
            for gpus in (1, 2):
                found.append(((kind, model, gpus, seq, dec, 4 * gpus),
                              (f"slapo-{kind}", model, gpus, seq, dec, 4 * gpus)))
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--cores", type=int, default=None,
                        help="cores per case (default: the harness's, one per rank)")
    parser.add_argument("--pairs", default="megatron,deepspeed,ablation")
    parser.add_argument("--models", default="bert-tiny")
    parser.add_argument("--json", help="also write the numbers here")
    args = parser.parse_args(argv)
    todo = pairs(args.pairs.split(","), args.models.split(","))
    rates = {i: ([], []) for i in range(len(todo))}
    print(f"{len(todo)} pairs x {args.rounds} rounds, {args.steps} steps ({args.warmup} warm-up); "
          f"{load()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_pairs_") as tmp:
        for r in range(args.rounds):
            for i, pair in enumerate(todo):
                order = (0, 1) if (r + i) % 2 == 0 else (1, 0)
                for side in order:
                    record = run_by_hand(pair[side], Path(tmp) / f"{i}-{side}.json", args.steps,
                                         args.warmup, args.cores)
                    value = rate(record)
                    if value is None:
                        raise SystemExit(f"{case_label(pair[side])}: {record['status']}: "
                                         f"{record['reason'][:500]}")
                    rates[i][side].append(value)
            print(f"round {r + 1}/{args.rounds} done; {load()}", flush=True)
    rows = []
    print(f"\n{'engine or earlier step':34s} {'samples/s [range]':>22s}   "
          f"{'Slapo or later step':34s} {'samples/s [range]':>22s}   ratio [range]")
    for i, (a, b) in enumerate(todo):
        ra, rb = rates[i]
        ratios = [y / x for x, y in zip(ra, rb)]
        row = {"a": case_label(a), "b": case_label(b), "a_stats": summary(ra),
               "b_stats": summary(rb), "ratio": statistics.median(ratios),
               "ratio_min": min(ratios), "ratio_max": max(ratios)}
        rows.append(row)
        print(f"{row['a']:34s} {fmt(row['a_stats']):>22s}   {row['b']:34s} "
              f"{fmt(row['b_stats']):>22s}   {row['ratio']:.2f} "
              f"[{row['ratio_min']:.2f}-{row['ratio_max']:.2f}]")
    print(f"\nafter: {load()}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "rounds": args.rounds,
                                               "steps": args.steps, "warmup": args.warmup},
                                              indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
