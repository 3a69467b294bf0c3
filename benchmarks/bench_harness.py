"""Benchmark of the harness itself (printed): one tiny case per system on CPU ranks.

For each system: the wall time of ``slapo-bench run`` (parent start to exit), the samples/s
it measured, and where the time went, from the timestamps in the record
(``metrics.extra.timeline``, seconds after the parent launched torchrun):

- ``start``: torchrun up and a rank's Python started (``worker_start``);
- ``setup``: imports, process group, model build, schedule, optimizer (``setup_done``);
- ``to step 1``: launch to the first training step (the harness's overhead before work);
- ``train``: all steps; ``after``: last step to the parent's exit (gathering, record, torchrun
  teardown, the parent's own bookkeeping).

    python benchmarks/bench_harness.py [--ranks 2] [--steps 6] [--warmup 2] [--seq-len 64]
                                       [--systems eager,deepspeed,...] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = {  # name -> (mode, model, extra args)
    "eager": ("eager", "bert-tiny", []),
    "slapo-megatron": ("slapo-megatron", "bert-tiny", []),
    "megatron": ("megatron", "bert-tiny", []),
    "deepspeed": ("deepspeed", "bert-tiny", []),
    "slapo-deepspeed": ("slapo-deepspeed", "bert-tiny", []),
    "megatron(gpt-neo)": ("megatron", "gpt-neo-tiny", []),
}


def run_one(mode, model, extra, args, workdir: Path) -> dict:
    sys.path.insert(0, str(ROOT))
    from slapo_ae.record import read_record

    out = workdir / f"{mode}-{model}.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    cmd = [sys.executable, "-m", "slapo_ae.harness.cli", "run", "--device", "cpu", "--mode", mode,
           "--model", model, "--gpus", str(args.ranks), "--seq-len", str(args.seq_len),
           "--batch-size", str(args.batch_size), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--out", str(out), "--quiet", *extra]
    start = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.time() - start
    if proc.returncode:
        return {"status": f"exit {proc.returncode}", "wall_s": wall, "error": proc.stderr[-500:]}
    record = read_record(out)
    row = {"status": record.status, "wall_s": wall, "samples_per_s": record.metrics.samples_per_s}
    t = record.metrics.extra.get("timeline")
    if t:
        launch = t["launch"]
        row.update({"start_s": t["worker_start"] - launch, "setup_s": t["setup_done"] - launch,
                    "to_first_step_s": t["first_step_start"] - launch,
                    "train_s": t["train_end"] - t["first_step_start"],
                    "after_s": start + wall - t["train_end"],
                    "parent_before_launch_s": launch - start})
    else:
        row["reason"] = record.reason.splitlines()[0]
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)

    print(f"harness benchmark: {args.ranks} CPU ranks, bert-tiny/gpt-neo-tiny, seq "
          f"{args.seq_len}, global batch {args.batch_size}, {args.steps} steps "
          f"({args.warmup} warm-up); {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.systems.split(","):
            mode, model, extra = SYSTEMS[name]
            rows[name] = run_one(mode, model, extra, args, Path(tmp))
            print(f"  ran {name}: {rows[name]['status']} in {rows[name]['wall_s']:.1f} s",
                  flush=True)
    cols = [("wall_s", "wall"), ("samples_per_s", "samples/s"),
            ("parent_before_launch_s", "parent"), ("start_s", "start"), ("setup_s", "setup"),
            ("to_first_step_s", "to step 1"), ("train_s", "train"), ("after_s", "after")]
    print()
    print(f"{'system':<20}" + "".join(f"{label:>11}" for _, label in cols))
    for name, row in rows.items():
        cells = "".join(f"{row[k]:>11.2f}" if isinstance(row.get(k), float) else f"{'-':>11}"
                        for k, _ in cols)
        print(f"{name:<20}{cells}  {row['status']}")
    print("\n(s unless noted; 'start', 'setup', 'to step 1' are seconds after torchrun was "
          "launched; 'after' = last step to the parent's exit)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
