"""Benchmark of the Snakemake workflow itself (printed):

1. dry-run time of the full ``paper`` DAG (72 Figure 7 + 4 Figure 9 cases, as on 8 GPUs);
2. time of a no-op rerun of that DAG once everything is built (cases run by the instant fake
   harness of the tests, so only Snakemake's own bookkeeping is timed);
3. wall time of the ``cpu`` profile from scratch (every case really trained on CPU ranks, the
   aggregates, figures, Table 4 and claims) -- long; skip with ``--skip-cpu``.

Each runs in a temporary copy of the repository (no Snakemake state, no results, its own
``.cache``), so ``results/`` here is left alone. Nothing is compiled on the way: the harness
marks DeepSpeed's CPU communication op incompatible (slapo_ae/harness/systems/deepspeed_zero3.py).

    python benchmarks/bench_workflow.py [--skip-cpu] [--skip-dag] [--cores 2] [--json out.json]
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "workflow"))
from wf_util import copy_workflow  # noqa: E402  (the workflow tests' sandbox)


def children_cpu_s() -> float:
    """CPU seconds (user + system) of every finished descendant so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def snakemake(repo: Path, *args, env=None) -> tuple[float, subprocess.CompletedProcess]:
    cmd = [sys.executable, "-m", "snakemake", "--workflow-profile", "workflow/profiles/default",
           *args]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, env=env)
    took = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return took, proc


def count_jobs(text: str, rule: str) -> int:
    return sum(1 for line in text.splitlines() if line.strip() in (f"rule {rule}:",
                                                                   f"localrule {rule}:"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-cpu", action="store_true", help="skip the cpu-profile run")
    parser.add_argument("--skip-dag", action="store_true", help="skip the paper-DAG timings")
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--json", help="also write the numbers here")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copies")
    args = parser.parse_args(argv)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    env.pop("TORCH_EXTENSIONS_DIR", None)  # the copy's own .cache (run_case's default)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    results = {"host": platform.node(), "cpus": os.cpu_count(), "cores": args.cores}
    tmp = Path(tempfile.mkdtemp(prefix="bench_workflow_"))
    try:
        # 1-2: the paper DAG, dry run and no-op rerun (fake harness, pretend 8 GPUs)
        repo = copy_workflow(tmp / "paper") if not args.skip_dag else None
        paper = ["--config", "profile=paper", "gpus=8",
                 f"gpu_slots_dir={tmp / 'slots'}", "harness=python tests/workflow/fake_harness.py"]
        if repo is not None:
            took, proc = snakemake(repo, "-n", *paper, env=env)
            cases = count_jobs(proc.stdout + proc.stderr, "case")
            results["paper_dry_run_s"] = round(took, 2)
            results["paper_cases"] = cases
            print(f"paper DAG dry run ({cases} cases): {took:.2f} s", flush=True)
            took, _ = snakemake(repo, *paper, "--cores", "8", "--resources", "gpus=8", env=env)
            results["paper_fake_full_run_s"] = round(took, 2)
            print(f"paper DAG full run with the instant fake harness: {took:.2f} s", flush=True)
            took, proc = snakemake(repo, *paper, "--cores", "8", "--resources", "gpus=8",
                                   env=env)
            assert "Nothing to be done" in proc.stdout + proc.stderr
            results["paper_noop_rerun_s"] = round(took, 2)
            print(f"paper DAG no-op rerun: {took:.2f} s", flush=True)

        # 3: the cpu profile from scratch, real harness
        if not args.skip_cpu:
            repo = copy_workflow(tmp / "cpu")
            cpu0, load0 = children_cpu_s(), os.getloadavg()
            took, proc = snakemake(repo, "--config", "profile=cpu", "--cores", str(args.cores),
                                   env=env)
            cpu_s = children_cpu_s() - cpu0
            results["cpu_profile_cpu_s"] = round(cpu_s, 1)
            results["cpu_profile_cpu_s_per_core"] = round(cpu_s / args.cores, 1)
            results["loadavg_before_after"] = [round(load0[0], 2), round(os.getloadavg()[0], 2)]
            results["cpu_profile_wall_s"] = round(took, 1)
            results["cpu_profile_cases"] = count_jobs(proc.stdout + proc.stderr, "case")
            statuses = {}
            for rel in ("results/e2e.csv", "results/ablation.csv"):
                with open(repo / rel) as handle:
                    for row in csv.DictReader(handle):
                        statuses[row["status"]] = statuses.get(row["status"], 0) + 1
            results["cpu_profile_statuses"] = statuses
            print(f"cpu profile from scratch ({results['cpu_profile_cases']} cases, "
                  f"{args.cores} cores): {took:.0f} s = {took / 60:.1f} min wall; "
                  f"{cpu_s:.0f} CPU s ({cpu_s / args.cores / 60:.1f} min per core: the wall "
                  f"time on an otherwise idle machine is about this or a little more); "
                  f"load average before/after {results['loadavg_before_after']}; "
                  f"statuses {statuses}", flush=True)
            print((repo / "results" / "claims.md").read_text().split("\n## ")[0])
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
