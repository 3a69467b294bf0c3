"""Benchmark: cases measured as workflow jobs equal the same cases run by hand (printed).

    python benchmarks/bench_fidelity.py [--rounds 2] [--cores N] [--models bert-tiny]
                                        [--json out.json]

The sample: every system of the cpu profile at 1 and 2 ranks on bert-tiny (Figure 7's four
systems from configs/e2e/cpu_tiny.cfg, the four ablation steps from
configs/ablation/cpu_tiny.cfg), with the cpu profile's steps and warm-up. Each round runs
every case both ways, back to back, alternating which goes first (the machine's speed drifts
over minutes here, so the two ways of a case are measured within a minute of each other):

- as a workflow job: ``snakemake --cores N --forcerun <record>`` in a temporary copy of the
  repository whose config has a ``fidelity`` profile of these cases: the real harness, rules
  and environment (``OMP_NUM_THREADS`` exported as the job's threads). CPU case jobs hold
  every core and run alone, so a job run by itself is what a job of the whole workflow sees;
- by hand: ``slapo-bench run ...`` from a shell without thread variables.

Printed per case: the median over the rounds of each run's median samples/s and the range of
those medians, both ways, their ratio (workflow / by hand) with its range over the rounds, and
the threads per rank each way; then the load. Target on an idle machine: every ratio within
0.85 to 1.15.
"""
from __future__ import annotations

import argparse
import json
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

from slapo_ae.cfg import parse_cfg_text  # noqa: E402
from slapo_ae.harness.threads import available_cores  # noqa: E402


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


def run_in_workflow(repo: Path, experiment: str, case_id: str, cores: int) -> dict:
    """The case as a job of the copy's workflow; returns its record."""
    from slapo_ae.record import read_record

    target = f"results/{experiment}/fidelity/{case_id}.json"
    cmd = [sys.executable, "-m", "snakemake", "--workflow-profile", "workflow/profiles/default",
           "--cores", str(cores), "--forcerun", target, "--", target]
    proc = subprocess.run(cmd, cwd=repo, env=user_env(), capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return read_record(repo / target).to_dict()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cores", type=int, default=available_cores(),
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
            for i, (exp, case) in enumerate(cases):
                ways = ("workflow", "by_hand") if (r + i) % 2 == 0 else ("by_hand", "workflow")
                for way in ways:
                    if way == "workflow":
                        record = run_in_workflow(repo, exp, case.id, args.cores)
                    else:
                        record = run_by_hand(case, tmp / f"{case.id}.json", cpu["steps"],
                                             cpu["warmup"])
                    value = rate(record)
                    if value is None:
                        raise SystemExit(f"{case.id} ({way}): {record['status']}: "
                                         f"{record['reason'][:500]}")
                    results[case.id][way].append(value)
                    results[case.id]["threads"][way] = record["env"].get("threads_per_rank")
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
        label = case_label(case)
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
