"""Run the case of an aggregate row again, through the harness CLI: for the back-to-back
re-measurements (:mod:`.recheck`) and the profiles of Slapo beside its engine (:mod:`.gaps`).

The case is the row's (mode, model, GPUs, lengths, batch, checkpointing) with the run settings
given here; its ranks get the harness's own thread budget (on CPU one core per rank, as the
workflow's cases). The caller holds the machine as a case job does, and on CPU the run takes
the machine's CPU slot as every case does (:func:`slapo_ae.harness.runner.cpu_lock_dir`), so
that it never measures beside another CPU case, whichever workflow started that one.
"""
from __future__ import annotations

import math
import os
import subprocess
from pathlib import Path

from slapo_ae.case import PIPELINE_MODES, Case, parse_ckpt
from slapo_ae.harness.runner import (
    DEFAULT_HARNESS,
    SLOTS_DIR_ENV,
    SLOTS_TOTAL_ENV,
    harness_command,
    harness_env,
    hold_device,
)
from slapo_ae.harness.runspec import default_timeout
from slapo_ae.record import Record, read_record


def _int(row, key, default=None):
    value = row.get(key)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return default
    return int(value)


def case_fields(row) -> dict:
    """The fields of an aggregate row that make its case, with its id and samples/s: its
    nodes, and its pipeline stages, tensor-parallel ranks and micro-batch where it has stages
    or replicas of a pipelined mode (the CSV holds the effective values)."""
    ckpt = row.get("ckpt")
    if ckpt is None or (isinstance(ckpt, float) and math.isnan(ckpt)):
        ckpt = "0"
    fields = {"case_id": row.get("case_id"), "mode": row["mode"], "model": row["model"],
              "gpus": int(row["gpus"]), "nodes": _int(row, "nodes", 1),
              "seq_len": int(row["seq_len"]), "dec_seq_len": int(row["dec_seq_len"]),
              "batch_size": int(row["batch_size"]), "ckpt": str(ckpt),
              "samples_per_s": float(row["samples_per_s"])}
    if row["mode"] in PIPELINE_MODES and (_int(row, "pp", 1) > 1 or _int(row, "dp", 1) > 1):
        fields.update(pp=_int(row, "pp"), tp=_int(row, "tp"),
                      micro_batch=_int(row, "micro_batch"))
    return fields


def run_again(fields: dict, out_dir: Path, steps: int, warmup: int, device: str, dtype: str,
              harness: str = DEFAULT_HARNESS, extra: tuple = (),
              timeout: float | None = None) -> Record | None:
    """Run the case of ``fields`` (:func:`case_fields`) for ``steps`` steps (``warmup`` of
    them untimed), record and log in ``out_dir``; ``extra``: more ``slapo-bench run``
    options; ``timeout``: the profile's for a case (default: the harness's for the device).
    On CUDA it holds the case's GPU slots, as the case runner does (the workflow's slots,
    where it set them). Returns the record, None if the harness left none."""
    out_dir.mkdir(parents=True, exist_ok=True)
    case = Case(mode=fields["mode"], model=fields["model"], gpus=fields["gpus"],
                seq_len=fields["seq_len"], dec_seq_len=fields["dec_seq_len"],
                batch_size=fields["batch_size"], batch_expr=str(fields["batch_size"]),
                ckpt=parse_ckpt(fields["mode"], fields["ckpt"]), steps=steps, warmup=warmup,
                dtype=dtype, device=device, nodes=fields.get("nodes", 1),
                **{key: fields[key] for key in ("pp", "tp", "micro_batch") if key in fields})
    record_path, log = out_dir / "record.json", out_dir / "run.log"
    record_path.unlink(missing_ok=True)  # a record left by an earlier run is not this one's
    cmd = harness_command(harness, case, timeout or default_timeout(device, steps),
                          str(record_path), str(log))
    env = harness_env()
    total = os.environ.get(SLOTS_TOTAL_ENV)
    # a case needing more GPUs than the slots holds none: the harness records it unsupported
    slot = hold_device(case, env, os.environ.get(SLOTS_DIR_ENV), int(total) if total else None)
    try:  # the harness inherits the slot's lock: it is held while any of its ranks runs
        subprocess.run(cmd + [*extra, "--quiet"], stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, env=env,
                       pass_fds=tuple(slot.fds) if slot else ())
    finally:
        if slot is not None:
            slot.release()
    return read_record(record_path) if record_path.is_file() else None
