"""Records -> one tidy table per experiment (``results/e2e.csv``, ``results/ablation.csv``,
``results/multinode.csv``).

One row per case record, whatever its status (failures are data): the case's fields (with its
nodes, GPUs per node and, where the case has them, its pipeline x tensor x data layout and
micro-batch), its status and reason, throughput (median samples/s of the timed steps and its
spread), TFLOPS per GPU, MFU, the largest rank's peak memory, and where it was measured
(device, CPU model and cores, host, package versions, commit). The experiment and profile come
from the record's path, ``results/<experiment>/<profile>/<case-id>.json``. ``slapo-megatron``
with pipeline stages is labelled Slapo-3D, without them Slapo-TP.

The ablation table adds each step's place in Figure 9 and its speedup over Vanilla.

    python -m slapo_ae.analysis.aggregate --experiment e2e --out results/e2e.csv REC.json ...
    python -m slapo_ae.analysis.aggregate --experiment multinode --out results/multinode.csv ...
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from slapo_ae import atomic
from slapo_ae.zoo import configs

SYSTEMS = ("megatron", "deepspeed", "slapo-megatron", "slapo-deepspeed")  # Figure 7's bars
SYSTEM_LABELS = {"megatron": "Megatron-LM", "deepspeed": "DeepSpeed ZeRO-3",
                 "slapo-megatron": "Slapo-TP", "slapo-deepspeed": "Slapo-ZeRO3"}
MULTINODE_SYSTEMS = ("megatron", "deepspeed", "slapo-megatron")  # Figure 8's bars
BASELINES = ("megatron", "deepspeed")
SLAPO_SYSTEMS = ("slapo-megatron", "slapo-deepspeed")
ABLATION_STEPS = ("eager", "slapo-kernel", "slapo-tp-attn-ffn", "slapo-tp-full")  # Figure 9
ABLATION_LABELS = {"eager": "Vanilla", "slapo-kernel": "+ Kernel Opt",
                   "slapo-tp-attn-ffn": "+ Attn/FFN TP", "slapo-tp-full": "+ Embedding TP"}

COLUMNS = [
    "experiment", "profile", "case_id", "mode", "system", "model", "model_label", "gpus",
    "nodes", "gpus_per_node", "pp", "tp", "dp", "micro_batch",
    "seq_len", "dec_seq_len", "batch_size", "ckpt", "status", "reason", "samples_per_s",
    "samples_per_s_min", "samples_per_s_max", "samples_per_s_q1", "samples_per_s_q3",
    "samples_per_s_iqr", "samples_per_s_stdev",
    "timed_steps", "tflops_per_gpu", "mfu", "peak_mem_gib", "device_name", "device_count",
    "cpu_model", "cpu_count", "hostname", "torch", "transformers", "deepspeed", "megatron_core",
    "git_commit",
    "started_at", "finished_at", "log_path", "record",
]
ABLATION_COLUMNS = ["step", "step_label", "speedup_vs_vanilla"]


def system_label(mode: str, pp=None) -> str:
    """The label of a system in tables and figures: Slapo-TP, or Slapo-3D where
    ``slapo-megatron`` has pipeline stages (``pp`` > 1); an ablation step's label; else the
    mode."""
    if mode == "slapo-megatron" and (pp or 1) > 1:
        return "Slapo-3D"
    return SYSTEM_LABELS.get(mode, ABLATION_LABELS.get(mode, mode))


def record_row(path) -> dict:
    """One table row of the record at ``path`` (see the module docstring)."""
    from slapo_ae.record import read_record

    rec = read_record(path)
    case, m, env = rec.case, rec.metrics, rec.env
    spread = m.spread or {}
    parts = Path(path).parts
    peaks = [p for p in (m.peak_mem_bytes or []) if p is not None]
    mode = case.get("mode")
    return {
        "experiment": parts[-3] if len(parts) >= 3 else None,
        "profile": parts[-2] if len(parts) >= 3 else None,
        "case_id": case.get("id") or Path(path).stem,
        "mode": mode,
        "system": system_label(mode, case.get("pp")),
        "model": case.get("model"),
        "model_label": configs.paper_label(case.get("model", "")),
        "gpus": case.get("gpus"),
        "nodes": case.get("nodes", 1),
        "gpus_per_node": case.get("gpus_per_node", case.get("gpus")),
        # the parallel layout, where the record has it (cases of the 3D interface)
        **{key: case.get(key) for key in ("pp", "tp", "dp", "micro_batch")},
        "seq_len": case.get("seq_len"),
        "dec_seq_len": case.get("dec_seq_len"),
        "batch_size": case.get("batch_size"),
        "ckpt": case.get("ckpt"),
        "status": rec.status,
        "reason": rec.reason,
        "samples_per_s": m.samples_per_s if rec.status == "ok" else None,
        "samples_per_s_min": spread.get("min"),
        "samples_per_s_max": spread.get("max"),
        "samples_per_s_q1": spread.get("q1"),
        "samples_per_s_q3": spread.get("q3"),
        "samples_per_s_iqr": spread.get("iqr"),
        "samples_per_s_stdev": spread.get("stdev"),
        "timed_steps": spread.get("steps"),
        "tflops_per_gpu": m.tflops_per_gpu,
        "mfu": m.mfu,
        "peak_mem_gib": max(peaks) / 2**30 if peaks else None,
        **{key: env.get(key) for key in ("device_name", "device_count", "cpu_model",
                                         "cpu_count", "hostname", "torch", "transformers",
                                         "deepspeed", "megatron_core", "git_commit")},
        "started_at": rec.started_at,
        "finished_at": rec.finished_at,
        "log_path": rec.log_path,
        "record": str(path),
    }


def table(paths):
    """A DataFrame with one row per record (columns :data:`COLUMNS`), sorted by model, GPUs
    and system."""
    import pandas as pd

    rows = [record_row(p) for p in paths]
    df = pd.DataFrame(rows, columns=COLUMNS)
    if df.empty:
        return df
    order = {m: i for i, m in enumerate(SYSTEMS + ABLATION_STEPS)}
    df["_order"] = df["mode"].map(order).fillna(len(order))
    df = df.sort_values(["model", "gpus", "_order", "case_id"], kind="stable")
    return df.drop(columns="_order").reset_index(drop=True)


def ablation_table(paths):
    """:func:`table` plus ``step`` (0 = Vanilla), ``step_label`` and ``speedup_vs_vanilla``
    (samples/s over Vanilla's; empty when either is not ok). Rows are in step order; modes
    that are not ablation steps are kept after them with no step."""
    df = table(paths)
    for col in ABLATION_COLUMNS:
        df[col] = None
    if df.empty:
        return df[COLUMNS + ABLATION_COLUMNS]
    steps = {m: i for i, m in enumerate(ABLATION_STEPS)}
    df["step"] = df["mode"].map(steps)
    df["step_label"] = df["mode"].map(ABLATION_LABELS)
    vanilla = df.loc[(df["mode"] == "eager") & (df["status"] == "ok"), "samples_per_s"]
    base = float(vanilla.iloc[0]) if len(vanilla) == 1 and vanilla.iloc[0] else None
    df["speedup_vs_vanilla"] = (df["samples_per_s"] / base) if base else None
    df = df.sort_values(["step", "case_id"], na_position="last", kind="stable")
    return df[COLUMNS + ABLATION_COLUMNS].reset_index(drop=True)


def write_csv(df, out) -> Path:
    """Write ``df`` to ``out`` atomically (:mod:`slapo_ae.atomic`)."""
    with atomic.replacing(out) as tmp:
        df.to_csv(tmp, index=False)
    return Path(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Aggregate case records into one CSV.")
    parser.add_argument("--experiment", choices=("e2e", "ablation", "multinode"),
                        required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("records", nargs="*")
    args = parser.parse_args(argv)
    make = ablation_table if args.experiment == "ablation" else table
    df = make(args.records)
    write_csv(df, args.out)
    counts = df["status"].value_counts().to_dict() if not df.empty else {}
    print(f"{args.out}: {len(df)} cases {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
