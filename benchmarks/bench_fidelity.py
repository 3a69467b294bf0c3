"""Benchmark: cases measured as workflow jobs equal the same cases run by hand (printed).

    python benchmarks/bench_fidelity.py [--rounds 2] [--cores N] [--models bert-tiny]
                                        [--json out.json]

The sample: every system of the cpu profile at 1 and 2 ranks on bert-tiny (Figure 7's four
systems from configs/e2e/cpu_tiny.cfg, the four ablation steps from
configs/ablation/cpu_tiny.cfg), with the cpu profile's steps and warm-up. Each round measures
the sample both ways, alternating which goes first:

- as workflow jobs: one ``snakemake --cores N --forcerun <records>`` of the whole sample in a
  temporary copy of the repository whose config has a ``fidelity`` profile of these cases:
  the real harness and rules, and Snakemake's scheduling (one-rank cases side by side when
  the cores allow, ``OMP_NUM_THREADS`` exported as each job's threads);
- by hand: ``slapo-bench run ...`` of each case in turn, from a shell without thread variables.

Printed per case: the median over the rounds of each run's median samples/s and the range of
those medians, both ways, their ratio (workflow / by hand) with its range over the rounds, and
the threads per rank each way; then the load. Target on an idle machine: every ratio within
0.85 to 1.15.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from harness_runs import ROOT, case_label, fmt, load, rate, run_by_hand, summary, user_env

sys.path.insert(0, str(ROOT / "tests" / "workflow"))
from wf_util import copy_workflow  # noqa: E402  (the workflow tests' sandbox)

from slapo.bench.cases import parse_cfg_text  # noqa: E402


def sample(models) -> dict[str, list[str]]:
    """cfg lines of the sample, per experiment."""
    e2e = [f"{mode} {model} 1,2 128 0 4*n 0" for model in models
           for mode in ("megatron", "slapo-megatron", "deepspeed", "slapo-deepspeed")]
    ablation = ["eager bert-tiny 1 128 0 8 0", "slapo-kernel bert-tiny 1 128 0 8 0",
                "slapo-tp-attn-ffn bert-tiny 2 128 0 16 0", "slapo-tp-full bert-tiny 2 128 0 16 0"]
    return {"e2e": e2e, "ablation": ablation}


def make_copy(dest: Path, lines: dict, cpu: dict) -> Path:
    """A copy of the repository whose ``fidelity`` profile holds the sample."""
    repo = copy_workflow(dest)
    experiments = {}
    for exp, cfg_lines in lines.items():
        cfg = repo / "configs" / exp / "fidelity.cfg"
        cfg.write_text("\n".join(cfg_lines) + "\n")
        experiments[exp] = [cfg.relative_to(repo).as_posix()]
    config = yaml.safe_load((ROOT / "configs" / "config.yaml").read_text())
    config["profile"] = "fidelity"
    config["profiles"] = {"fidelity": {**cpu, "experiments": experiments}}
    (repo / "configs" / "config.yaml").write_text(yaml.safe_dump(config))
    return repo


def run_in_workflow(repo: Path, cases, cores: int) -> dict[str, dict]:
    """Every case of ``cases`` (``[(experiment, Case)]``) as jobs of one Snakemake run;
    returns ``{case id: record}``."""
    from slapo.bench.record import read_record

    targets = {case.id: f"results/{exp}/fidelity/{case.id}.json" for exp, case in cases}
    cmd = [sys.executable, "-m", "snakemake", "--workflow-profile", "workflow/profiles/default",
           "--cores", str(cores), "--forcerun", *targets.values(), "--", *targets.values()]
    env = {**user_env(), "TORCH_EXTENSIONS_DIR": str(ROOT / ".cache" / "torch_extensions")}
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"snakemake failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return {case_id: read_record(repo / target).to_dict() for case_id, target in targets.items()}


def run_by_hand_all(cases, tmp: Path, cpu: dict) -> dict[str, dict]:
    """Every case of ``cases`` through ``slapo-bench run``, one after the other."""
    found = {}
    for _, case in cases:
        shape = (case.mode, case.model, case.gpus, case.seq_len, case.dec_seq_len,
                 case.batch_size)
        found[case.id] = run_by_hand(shape, tmp / f"{case.id}.json", cpu["steps"],
                                     cpu["warmup"])
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)),
                        help="the workflow's cores (default: all available)")
    parser.add_argument("--models", default="bert-tiny")
    parser.add_argument("--json", help="also write the numbers here")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copy")
    args = parser.parse_args(argv)
    cpu = yaml.safe_load((ROOT / "configs" / "config.yaml").read_text())["profiles"]["cpu"]
    cpu = {k: cpu[k] for k in ("device", "dtype", "steps", "warmup", "timeout", "max_gpus")}
    lines = sample(args.models.split(","))
    cases = [(exp, case) for exp, cfg_lines in lines.items()
             for case in parse_cfg_text("\n".join(cfg_lines), f"fidelity {exp}",
                                        max_gpus=cpu["max_gpus"])]
    tmp = Path(tempfile.mkdtemp(prefix="bench_fidelity_"))
    repo = make_copy(tmp / "repo", lines, cpu)
    results = {case.id: {"workflow": [], "by_hand": [], "threads": {}} for _, case in cases}
    print(f"{len(cases)} cases x {args.rounds} rounds x 2 ways, {cpu['steps']} steps "
          f"({cpu['warmup']} warm-up), snakemake --cores {args.cores}; {load()}", flush=True)
    try:
        for r in range(args.rounds):
            ways = ("workflow", "by_hand") if r % 2 == 0 else ("by_hand", "workflow")
            for way in ways:
                records = (run_in_workflow(repo, cases, args.cores) if way == "workflow"
                           else run_by_hand_all(cases, tmp, cpu))
                for case_id, record in records.items():
                    value = rate(record)
                    if value is None:
                        raise SystemExit(f"{case_id} ({way}): {record['status']}: "
                                         f"{record['reason'][:500]}")
                    results[case_id][way].append(value)
                    results[case_id]["threads"][way] = record["env"].get("threads_per_rank")
            print(f"round {r + 1}/{args.rounds} done; {load()}", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    rows = []
    print(f"\n{'case':36s} {'workflow [range]':>22s} {'by hand [range]':>22s}   "
          f"ratio [range]   threads/rank")
    for _, case in cases:
        res = results[case.id]
        ratios = [w / h for w, h in zip(res["workflow"], res["by_hand"])]
        row = {"case": case.id, "workflow": summary(res["workflow"]),
               "by_hand": summary(res["by_hand"]), "ratio": statistics.median(ratios),
               "ratio_min": min(ratios), "ratio_max": max(ratios), "threads": res["threads"]}
        rows.append(row)
        label = case_label((case.mode, case.model, case.gpus))
        print(f"{label:36s} {fmt(row['workflow']):>22s} {fmt(row['by_hand']):>22s}   "
              f"{row['ratio']:.2f} [{row['ratio_min']:.2f}-{row['ratio_max']:.2f}]   "
              f"{res['threads'].get('workflow')} / {res['threads'].get('by_hand')}")
    inside = sum(0.85 <= row["ratio"] <= 1.15 for row in rows)
    print(f"\n{inside} of {len(rows)} ratios within 0.85-1.15; after: {load()}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "rounds": args.rounds,
                                               "cores": args.cores, "profile": cpu}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
