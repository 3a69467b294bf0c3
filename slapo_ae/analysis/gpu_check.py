"""The one-GPU check: Slapo against what a user would pick instead, on one GPU, in one run.

    python -m slapo_ae.analysis.gpu_check run configs/gpu_check/llama.cfg \
--out results/reference/h200/llama
    python -m slapo_ae.analysis.gpu_check judge results/reference/h200/llama

The check comes in parts, one cfg file each in ``configs/gpu_check/`` (one model a part), so
that a part fits one call of a GPU lent for minutes (``scripts/gpu_check.sh PART``).

``run`` runs the cases of a cfg file one after another through the harness
(``slapo-bench run`` in this process: its own ranks, timeout and record per case), writing
``OUT/<case id>.json`` and ``OUT/logs/<case id>.log``; the cases of :data:`PROFILED_MODES` then
train :data:`PROFILE_STEPS` more steps under torch.profiler (``--profile-after``, outside their
figures) into ``OUT/profiles/<case id>/``. A case whose record is already ``ok`` or
``unsupported`` is kept (a rerun resumes and retries failures). ``--deadline`` bounds the cases'
time together: each case's timeout is cut to what is left of it, and no case starts with less
than ``--min-case`` seconds left, so a part ends in time whatever its cases do. It ends with
``judge``.

``judge`` reads the records of a folder and checks, per model, three targets and the losses,
all from the same GPU and the same run, into ``OUT/summary.md`` and ``OUT/summary.json``:

- ``T1``: ``slapo-megatron`` (TP=1, kernel optimisation) reaches at least
  :data:`T1_MIN_SPEEDUP` times the samples/s of the best of :data:`T1_BASELINES`, judged only
  once every baseline has an outcome (``ok``, ``unsupported`` or ``oom``): a baseline that did
  not run or failed (a timeout included) might have been the best;
- ``T2``: ``slapo-deepspeed`` reaches at least :data:`T2_MIN_SPEEDUP` times ``deepspeed``'s
  samples/s (plain ZeRO-3) at no more peak memory;
- ``T3``: the better of the two Slapo systems reaches a model FLOPs utilization of at least
  :func:`t3_min_mfu` (40% for BERT, 45% for the decoders);
- ``L``: each Slapo system's loss follows the reference's on the same seed and data
  (Slapo-TP: ``hf-sdpa``, else ``eager`` or ``hf-compile`` where HF has no SDPA; Slapo-ZeRO3:
  ``deepspeed``, which starts from the same weights, :data:`LOSS_REFERENCES`): at every step,
  warm-up included, within :data:`LOSS_RTOL` of it (relative). At random initialisation the losses
  sit near ``ln(vocabulary)``, so this catches a wrong loss (another target, a lost scale, a
  diverging step), not small numeric drift: the schedules' numerical equality with the plain
  model is shown by the CPU tests, in fp32, at 1e-5.

A target is ``NOT-RUN`` (with the reason) when a record it needs is missing or not ``ok``,
with two exceptions, the claims' rule (``slapo_ae.analysis.claims``): a Slapo system that ran
out of memory or failed (not by its time limit, which the check's deadline cuts) where what it
is compared with ran ``ok`` fails the target; and where Slapo ran ``ok`` and what it is
compared with ran out of memory (no T1 baseline ran ``ok``, or ``deepspeed`` for T2), Slapo
passes, with no ratio.
The summary ends with the profiled systems side by side, per step: their kernel time and calls
by kind (matrix products, attention, optimizer, casts, the rest) and by operator, and the time
a timed step spends outside kernels against the commands (kernel launches, memsets, copies)
that put work on the GPU: the share that fewer kernels, or CUDA graphs, could win.
Both commands exit 1 where a target failed or a case failed, 2 on bad input.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from slapo_ae.atomic import write_text

T1_MIN_SPEEDUP = 1.1
T2_MIN_SPEEDUP = 1.0
T3_MIN_MFU = 0.45  # the decoders'
T3_MIN_MFU_BY_FAMILY = {"bert": 0.40, "roberta": 0.40}
T1_BASELINES = ("hf-sdpa", "hf-compile", "hf-liger", "megatron")
SLAPO_MODES = ("slapo-megatron", "slapo-deepspeed")
# The loss check: relative difference allowed at every step (see the module docstring), and
# each Slapo system's references, in order of preference: systems that start from the same
# weights. The ZeRO-3 systems build the model on CPU (DeepSpeed partitions it from there: a
# model it trains may not fit one GPU whole), so their weights come from CPU's generator and
# the others' from the GPU's; and DeepSpeed trains bf16 weights and logs a bf16 loss.
LOSS_RTOL = 0.01
LOSS_REFERENCES = {"slapo-megatron": ("hf-sdpa", "eager", "hf-compile"),
                   "slapo-deepspeed": ("deepspeed",)}
# Anchors measured on one H200 (bf16, AdamW, 10 timed steps after 3 warm-up), samples/s,
# shown beside the measured numbers in summary.md (megatron's is its GPT-1.3B for GPT-Neo).
H200_ANCHORS = {
    ("bert-large-uncased", "eager"): 160, ("bert-large-uncased", "hf-sdpa"): 271,
    ("bert-large-uncased", "hf-compile"): 228, ("bert-large-uncased", "deepspeed"): 63,
    ("EleutherAI/gpt-neo-1.3B", "eager"): 21.9, ("EleutherAI/gpt-neo-1.3B", "hf-compile"): 49.6,
    ("EleutherAI/gpt-neo-1.3B", "deepspeed"): 14.5, ("EleutherAI/gpt-neo-1.3B", "megatron"): 25.9,
    ("facebook/opt-1.3b", "hf-sdpa"): 48.2, ("llama-1.1b", "hf-sdpa"): 46.2,
}
# Profiled after their timed steps (``slapo-bench run --profile-after``), so that the summary
# says where each one's GPU time goes: Slapo-TP and the baseline that was T1's best on both
# models measured so far (2026-12-04).
PROFILED_MODES = ("slapo-megatron", "hf-compile")
PROFILE_STEPS = 2
PROFILE_TOP_OPS = 12  # per system, in the summary's table
PROFILE_TOP_COPIES = 5  # a profiled system's largest eager copies, by shapes
# Kernel time by kind, from the operators that launched the kernels (the rest: Inductor's
# other kernels, eager elementwise work, copies, the loss). Casts: Inductor's kernels that do
# nothing but cast (autocast's weight and gradient casts among them), by their names.
KERNEL_KINDS = (
    ("matrix products", re.compile(r"aten::(mm|addmm|bmm|baddbmm|addbmm|_scaled_mm)$")),
    ("attention", re.compile(r"aten::_?\w*attention\w*$")),
    ("optimizer", re.compile(r"aten::_(fused_adam|foreach_)\w*$")),
    ("casts", re.compile(r"triton_(poi|per|red)_fused__to_copy(_(view|t|clone|permute|expand|"
                         r"_unsafe_view))*_\d+$")),
)
# The CUDA runtime and driver calls that put work on the GPU, as torch.profiler names them.
# On the 2026-12-06 H100 profiles each step also issued about one memset per matrix product.
GPU_COMMANDS = {"kernel launches": ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel",
                                    "cuLaunchKernelEx", "cudaLaunchCooperativeKernel",
                                    "cudaGraphLaunch"),
                "memsets": ("cudaMemsetAsync",), "copies": ("cudaMemcpyAsync",)}
# CUDA runtime calls in which the CPU waits for the GPU: at the harness's syncs between steps,
# the lead the CPU's launches had over the GPU's work (a CPU that only just keeps ahead of
# its GPU, as in a launch-bound step, waits little)
SYNC_WAITS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize")
SETTLED = ("ok", "unsupported")  # a rerun keeps these records; failed and oom cases run again
# A baseline with one of these outcomes is out of T1's comparison for a reason of its own; no
# record or a failed one (a timeout included) leaves T1 unjudged.
T1_BASELINE_OUTCOMES = ("ok", "unsupported", "oom")


def t3_min_mfu(model: str) -> float:
    """T3's threshold for ``model``: by its family, :data:`T3_MIN_MFU` for the decoders."""
    from slapo_ae.zoo.configs import model_family

    return T3_MIN_MFU_BY_FAMILY.get(model_family(model), T3_MIN_MFU)


@dataclass(frozen=True)
class Verdict:
    model: str
    target: str      # T1, T2, T3, L
    verdict: str     # PASS, FAIL, NOT-RUN
    value: float | None
    threshold: float
    detail: str


def _ok(records: dict, model: str, mode: str):
    """The ``ok`` record of (model, mode), or None."""
    record = records.get((model, mode))
    return record if record is not None and record.status == "ok" else None


def _why_missing(records: dict, model: str, mode: str) -> str:
    record = records.get((model, mode))
    if record is None:
        return f"{mode}: no record"
    return f"{mode}: {record.status} ({(record.reason or '').splitlines()[0][:120]})"


def _broke(record) -> bool:
    """Whether the case ran and could not train: out of memory, or failed other than by its
    time limit (the check's deadline cuts the cases' timeouts, so a timeout says nothing of the
    system; the harness marks one ``metrics.extra["timed_out"]``)."""
    if record is None:
        return False
    timed_out = bool((record.metrics.extra or {}).get("timed_out"))
    return record.status == "oom" or (record.status == "failed" and not timed_out)


def judge_model(records: dict, model: str) -> list[Verdict]:
    """The three targets for ``model``; ``records`` maps (model, mode) to a Record."""
    out = []
    slapo_tp = _ok(records, model, "slapo-megatron")
    baselines = {m: _ok(records, model, m) for m in T1_BASELINES}
    ran = {m: r.metrics.samples_per_s for m, r in baselines.items() if r is not None}
    unjudged = [m for m in T1_BASELINES
                if getattr(records.get((model, m)), "status", None) not in T1_BASELINE_OUTCOMES]
    if _broke(records.get((model, "slapo-megatron"))) and ran:
        out.append(Verdict(model, "T1", "FAIL", None, T1_MIN_SPEEDUP,
                           f"{_why_missing(records, model, 'slapo-megatron')} where "
                           + ", ".join(f"{m} ran ({v:.4g} samples/s)" for m, v in ran.items())))
    elif slapo_tp is not None and not ran and not unjudged and any(
            records[model, m].status == "oom" for m in T1_BASELINES):
        out.append(Verdict(model, "T1", "PASS", None, T1_MIN_SPEEDUP,
                           f"slapo-megatron {slapo_tp.metrics.samples_per_s:.4g} samples/s where "
                           "no baseline trained: " + "; ".join(
                               _why_missing(records, model, m) for m in T1_BASELINES)))
    elif slapo_tp is None or not ran or unjudged:
        why = [_why_missing(records, model, "slapo-megatron")] if slapo_tp is None else []
        why += [_why_missing(records, model, m) for m in T1_BASELINES
                if baselines[m] is None and (m in unjudged or not ran)]
        out.append(Verdict(model, "T1", "NOT-RUN", None, T1_MIN_SPEEDUP, "; ".join(why)))
    else:
        best = max(ran, key=ran.get)
        speedup = slapo_tp.metrics.samples_per_s / ran[best]
        rates = ", ".join(f"{m} {v:.4g}" for m, v in ran.items())
        out.append(Verdict(model, "T1", "PASS" if speedup >= T1_MIN_SPEEDUP else "FAIL",
                           speedup, T1_MIN_SPEEDUP,
                           f"slapo-megatron {slapo_tp.metrics.samples_per_s:.4g} samples/s "
                           f"against best baseline {best} (baselines: {rates})"
                           + _ratio_range(slapo_tp, baselines[best])))
    out.append(_judge_t2(records, model))
    threshold = t3_min_mfu(model)
    mfus = {m: r.metrics.mfu for m in SLAPO_MODES
            if (r := _ok(records, model, m)) is not None and r.metrics.mfu is not None}
    # neither Slapo system trained, one broke, and another system trained at this shape
    broke = [m for m in SLAPO_MODES if _broke(records.get((model, m)))]
    others_ran = [m for (name, m), r in records.items()
                  if name == model and m not in SLAPO_MODES and r.status == "ok"]
    if broke and others_ran and not any(_ok(records, model, m) for m in SLAPO_MODES):
        out.append(Verdict(model, "T3", "FAIL", None, threshold,
                           "; ".join(_why_missing(records, model, m) for m in broke)
                           + f" where {', '.join(sorted(others_ran))} ran"))
    elif not mfus:
        out.append(Verdict(model, "T3", "NOT-RUN", None, threshold,
                           "no ok Slapo record with a known device peak (MFU needs a GPU whose "
                           "peak FLOPS slapo_ae.harness.metrics knows)"))
    else:
        best = max(mfus, key=mfus.get)
        note = _local_attention_note(model, records[model, best].case.get("seq_len"))
        out.append(Verdict(model, "T3", "PASS" if mfus[best] >= threshold else "FAIL",
                           mfus[best], threshold, f"best Slapo system: {best}{note}"))
    out.append(_judge_losses(records, model))
    return out


def _local_attention_note(model: str, seq_len: int | None) -> str:
    """What the FLOPs formula charges a model's local-window attention beyond the window
    (GPT-Neo's local layers), which its MFU then counts as work done; "" where nothing."""
    from slapo_ae.harness.flops import local_attention_excess
    from slapo_ae.zoo.configs import load_config

    excess = local_attention_excess(load_config(model), seq_len) if seq_len else 0.0
    if not excess:
        return ""
    return (f"; the FLOPs formula charges the local layers' attention as dense: {excess:.1%} "
            "of the model FLOPs lie beyond their window, which the MFU counts as work done")


def _ratio_range(a, b) -> str:
    """The ratio of ``a``'s samples/s to ``b``'s over their timed steps' interquartile ranges
    (``a``'s first quartile against ``b``'s third, and the other way round): how far one run's
    step-to-step spread could move the verdict. Empty where a record has no spread."""
    sa, sb = a.metrics.spread, b.metrics.spread
    if not sa or not sb or not sb.get("q1") or not sb.get("q3"):
        return ""
    return (f"; over the steps' interquartile ranges {sa['q1'] / sb['q3']:.2f}x to "
            f"{sa['q3'] / sb['q1']:.2f}x")


def _peak(record) -> int:
    return max(record.metrics.peak_mem_bytes or [0])


def _judge_t2(records: dict, model: str) -> Verdict:
    slapo_ds, ds = _ok(records, model, "slapo-deepspeed"), _ok(records, model, "deepspeed")
    if slapo_ds is None and ds is not None and _broke(records.get((model, "slapo-deepspeed"))):
        return Verdict(model, "T2", "FAIL", None, T2_MIN_SPEEDUP,
                       f"{_why_missing(records, model, 'slapo-deepspeed')} where deepspeed ran "
                       f"({ds.metrics.samples_per_s:.4g} samples/s)")
    if slapo_ds is not None and getattr(records.get((model, "deepspeed")), "status", None) == "oom":
        return Verdict(model, "T2", "PASS", None, T2_MIN_SPEEDUP,
                       f"slapo-deepspeed {slapo_ds.metrics.samples_per_s:.4g} samples/s at "
                       f"{_peak(slapo_ds) / 2**30:.1f} GiB where "
                       f"{_why_missing(records, model, 'deepspeed')}")
    if slapo_ds is None or ds is None:
        why = [_why_missing(records, model, m) for m, r in
               (("slapo-deepspeed", slapo_ds), ("deepspeed", ds)) if r is None]
        return Verdict(model, "T2", "NOT-RUN", None, T2_MIN_SPEEDUP, "; ".join(why))
    speedup = slapo_ds.metrics.samples_per_s / ds.metrics.samples_per_s
    memory = _peak(slapo_ds) / max(_peak(ds), 1)
    passed = speedup >= T2_MIN_SPEEDUP and memory <= 1.0
    return Verdict(model, "T2", "PASS" if passed else "FAIL", speedup, T2_MIN_SPEEDUP,
                   f"slapo-deepspeed {slapo_ds.metrics.samples_per_s:.4g} against deepspeed "
                   f"{ds.metrics.samples_per_s:.4g} samples/s{_ratio_range(slapo_ds, ds)}; "
                   f"peak memory {_peak(slapo_ds) / 2**30:.1f} against "
                   f"{_peak(ds) / 2**30:.1f} GiB ({memory:.2f}x, at most 1.00x); deepspeed "
                   "runs the model as the paper's baseline did, with HF's eager attention, "
                   "and Slapo's schedule puts it on SDPA, which writes out no scores")


def _judge_losses(records: dict, model: str) -> Verdict:
    """``L``: each ok Slapo system's losses against its first ok reference's, step by step
    (:data:`LOSS_REFERENCES`). PASS only when every ok Slapo system was judged."""
    slapo = [m for m in SLAPO_MODES if _ok(records, model, m)]
    if not slapo:
        return Verdict(model, "L", "NOT-RUN", None, LOSS_RTOL, "no ok Slapo record")
    worst, verdict, details = None, "PASS", []
    for mode in slapo:
        references = LOSS_REFERENCES[mode]
        reference = next((m for m in references if _ok(records, model, m)), None)
        losses = records[(model, mode)].metrics.loss or []
        ref = (records[(model, reference)].metrics.loss or []) if reference else []
        if reference is None:
            why = "no ok reference: " + "; ".join(_why_missing(records, model, m)
                                                  for m in references)
        elif not ref or len(losses) != len(ref):
            why = f"{mode} logged {len(losses)} losses, {reference} {len(ref)}"
        else:
            why = None
        if why:
            verdict = "FAIL" if verdict == "FAIL" else "NOT-RUN"
            details.append(f"{mode} not judged: {why}")
            continue
        error = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
        worst = error if worst is None else max(worst, error)
        if error > LOSS_RTOL:
            verdict = "FAIL"
        details.append(f"{mode} {losses[0]:.4g} -> {losses[-1]:.4g} against {reference} "
                       f"{ref[0]:.4g} -> {ref[-1]:.4g} (max {error:.2%} off)")
    return Verdict(model, "L", verdict, worst, LOSS_RTOL, "; ".join(details))


def load_records(folder) -> dict:
    """(model, mode) -> Record of every ``*.json`` record in ``folder``."""
    from slapo_ae.record import read_record

    records = {}
    for path in sorted(Path(folder).glob("*.json")):
        if path.name == "summary.json":
            continue
        record = read_record(path)
        records[(record.case["model"], record.case["mode"])] = record
    return records


def cudnn_text(version: int) -> str:
    """``torch.backends.cudnn.version()`` as cuDNN writes it: 91501 -> 9.15.1, 8907 -> 8.9.7."""
    major, rest = divmod(version, 10000 if version >= 10000 else 1000)
    return f"{major}.{rest // 100}.{rest % 100}"


def _hardware(records: dict) -> str:
    def versions(env):  # cuDNN's decides which attention kernel SDPA prefers
        return f"torch {env.get('torch')}" + (
            f", cuDNN {cudnn_text(env['cudnn'])}" if env.get("cudnn") else "")

    names = sorted({f"{r.env.get('device_name')} ({versions(r.env)})"
                    for r in records.values() if r.status == "ok"})
    return "; ".join(names) or "no ok record"


def judge(folder) -> list[Verdict]:
    """Judge the records in ``folder``; writes ``summary.md`` and ``summary.json`` there."""
    folder = Path(folder)
    records = load_records(folder)
    models = sorted({model for model, _ in records})
    verdicts = [v for model in models for v in judge_model(records, model)]
    write_text(folder / "summary.json", json.dumps(
        {"hardware": _hardware(records), "verdicts": [asdict(v) for v in verdicts]}, indent=1))
    lines = ["# One-GPU check", "", f"Hardware: {_hardware(records)}.", "",
             f"T1: slapo-megatron >= {T1_MIN_SPEEDUP}x best of {', '.join(T1_BASELINES)}; "
             f"T2: slapo-deepspeed >= {T2_MIN_SPEEDUP}x deepspeed at no more peak memory; "
             f"T3: best Slapo MFU >= {T3_MIN_MFU:.0%} (decoders), "
             f"{T3_MIN_MFU_BY_FAMILY['bert']:.0%} (BERT); "
             f"L: every step's loss within {LOSS_RTOL:.0%} of the reference's ("
             + "; ".join(f"{mode}: {' / '.join(refs)}" for mode, refs in LOSS_REFERENCES.items())
             + ").", "",
             "| model | target | verdict | value | needed | detail |",
             "|---|---|---|---:|---:|---|"]
    percent = ("T3", "L")
    for v in verdicts:
        value = "-" if v.value is None else (f"{v.value:.1%}" if v.target in percent
                                             else f"{v.value:.2f}x")
        needed = f"{v.threshold:.0%}" if v.target in percent else f"{v.threshold:g}x"
        lines.append(f"| {v.model} | {v.target} | {v.verdict} | {value} | {needed} | {v.detail} |")
    lines += ["", "Step ms: the median timed step; CPU wait ms: rank 0's median wait in the "
              "synchronize that closes a timed step, the lead the CPU's launches had over the "
              "GPU (near 0: the CPU's launches bound the step, or the step waited for the GPU "
              "itself near its end).",
              "", "| model | mode | status | samples/s | TFLOPS | MFU | peak GiB | step ms | "
              "CPU wait ms | H200 anchor |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for (model, mode), r in sorted(records.items()):
        m = r.metrics
        step, wait = timed_step_ms(r), timed_sync_wait_ms(r)
        cells = ([f"{m.samples_per_s:.4g}", f"{m.tflops_per_gpu:.4g}",
                  "-" if m.mfu is None else f"{m.mfu:.1%}", f"{_peak(r) / 2**30:.1f}",
                  "-" if step is None else f"{step:.1f}", "-" if wait is None else f"{wait:.1f}"]
                 if r.status == "ok" else ["-"] * 6)
        cells.append(str(H200_ANCHORS.get((model, mode), "-")))
        lines.append(f"| {model} | {mode} | {r.status} | " + " | ".join(cells) + " |")
    lines += ["", "## What each system ran (from its record)", ""]
    for (model, mode), r in sorted(records.items()):
        extra = r.metrics.extra or {}
        facts = [f"precision: {extra['precision']}"] if extra.get("precision") else []
        facts += [f"optimizer: {extra['optimizer']}"] if extra.get("optimizer") else []
        facts += list(extra.get("notes") or [])
        if r.status != "ok":
            facts.insert(0, f"{r.status}: {(r.reason or '').splitlines()[0][:200]}")
        lines.append(f"- {model}, {mode}: " + ("; ".join(facts) or "-"))
    lines += profile_lines(folder, records)
    write_text(folder / "summary.md", "\n".join(lines) + "\n")
    return verdicts


def device_profile(folder, record) -> dict | None:
    """Rank 0's profile of ``record``'s case under ``folder/profiles/`` (``slapo-bench run
    --profile``), per profiled step: its wall time, all kernels' time and each operator's
    share of it, in milliseconds, each such operator's calls, and how many of each of
    :data:`GPU_COMMANDS` it issued, the CPU's wait in :data:`SYNC_WAITS`, and its eager
    copies (``aten::copy_``) by input shapes where the profile has them; None where there is
    none with device times (not profiled, or profiled on CPU)."""
    path = Path(folder) / "profiles" / record.id / "rank0.ops.json"
    try:
        profile = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    steps = profile.get("steps") or 0
    if not steps or "device_us" not in profile:
        return None
    ops = profile["ops"]
    return {"steps": steps, "wall_ms": profile["wall_us"] / 1e3 / steps,
            "device_ms": profile["device_us"] / 1e3 / steps,
            "ops": {name: op["self_device_us"] / 1e3 / steps
                    for name, op in ops.items() if op.get("self_device_us")},
            "calls": {name: op["calls"] / steps for name, op in ops.items()
                      if op.get("self_device_us")},
            "commands": {kind: sum(ops[name]["calls"] for name in names if name in ops) / steps
                         for kind, names in GPU_COMMANDS.items()},
            "sync_wait_ms": sum(ops[name].get("self_cpu_us", 0) for name in SYNC_WAITS
                                if name in ops) / 1e3 / steps,
            "copies": [{"shapes": row["input_shapes"], "calls": row["calls"] / steps,
                        "ms": row["self_device_us"] / 1e3 / steps}
                       for row in profile.get("by_shape", [])
                       if row["op"] == "aten::copy_" and row.get("self_device_us")]}


def _timed_median_ms(record, per_step_s) -> float | None:
    """The median of per-step seconds over ``record``'s timed steps (warm-up left out), in
    ms; None where there are none."""
    timed = (per_step_s or [])[record.metrics.warmup_steps or 0:]
    return statistics.median(timed) * 1e3 if timed else None


def timed_step_ms(record) -> float | None:
    """The median of a record's timed steps (warm-up left out, no profiler), in ms."""
    return _timed_median_ms(record, record.metrics.step_times)


def timed_sync_wait_ms(record) -> float | None:
    """Rank 0's median wait at the synchronize closing each timed step, in ms (the record's
    ``sync_wait_s``: CUDA only); None where the record has none."""
    waits = (record.metrics.extra or {}).get("sync_wait_s")
    return _timed_median_ms(record, waits[0] if waits else None)


def _kind_rows(profiles: dict, timed: dict, waits: dict) -> list[str]:
    """The rows of the profile table before its operators: the timed step, the kernels by
    kind, the time outside kernels, the CPU's lead and the commands that put work on the
    GPU."""
    def row(label, values, fmt):
        return f"| ({label}) | " + " | ".join("-" if v is None else fmt.format(v)
                                            for v in values) + " |"

    def of_kind(m, what, pattern):
        return sum(v for name, v in profiles[m][what].items() if pattern.match(name))

    modes = list(profiles)
    kinds = {m: {label: of_kind(m, "ops", pattern) for label, pattern in KERNEL_KINDS}
             for m in modes}
    outside = {m: None if timed[m] is None else timed[m] - profiles[m]["device_ms"]
               for m in modes}
    commands = {m: sum(profiles[m]["commands"].values()) for m in modes}
    rows = [row("wall", [profiles[m]["wall_ms"] for m in modes], "{:.1f}"),
            row("timed step, median, unprofiled", [timed[m] for m in modes], "{:.1f}"),
            row("all kernels", [profiles[m]["device_ms"] for m in modes], "{:.1f}")]
    rows += [row(label, [kinds[m][label] for m in modes], "{:.1f}") for label, _ in KERNEL_KINDS]
    rows += [row("other kernels", [profiles[m]["device_ms"] - sum(kinds[m].values())
                                   for m in modes], "{:.1f}"),
             row("timed step less all kernels", [outside[m] for m in modes], "{:.1f}"),
             row("CPU waiting for the GPU at syncs, profiled",
                 [profiles[m]["sync_wait_ms"] for m in modes], "{:.1f}"),
             row("CPU waiting for the GPU at the step's end, median, unprofiled",
                 [waits[m] for m in modes], "{:.1f}")]
    rows += [row(f"{label}, calls", [of_kind(m, "calls", pattern) for m in modes], "{:.0f}")
             for label, pattern in KERNEL_KINDS]
    rows += [row(f"{kind}, count", [profiles[m]["commands"][kind] for m in modes], "{:.0f}")
             for kind in GPU_COMMANDS]
    rows.append(row("microseconds outside kernels per command",
                    [outside[m] * 1e3 / commands[m] if outside[m] is not None and commands[m]
                     else None for m in modes], "{:.2f}"))
    return rows


def profile_lines(folder, records: dict) -> list[str]:
    """The summary's section on where the GPU time goes: per model, its profiled systems side
    by side, per step: the kernel time by kind and of each one's largest operators, and the
    time outside kernels against the commands issued."""
    lines = []
    for model in sorted({model for model, _ in records}):
        profiled = {mode: (r, p) for (m, mode), r in sorted(records.items())
                    if m == model and r.status == "ok" and (p := device_profile(folder, r))}
        if not profiled:
            continue
        profiles = {mode: p for mode, (_, p) in profiled.items()}
        timed = {mode: timed_step_ms(r) for mode, (r, _) in profiled.items()}
        waits = {mode: timed_sync_wait_ms(r) for mode, (r, _) in profiled.items()}
        top = []
        for p in profiles.values():
            for name in sorted(p["ops"], key=p["ops"].get, reverse=True)[:PROFILE_TOP_OPS]:
                if name not in top:
                    top.append(name)
        modes = list(profiles)
        steps = ", ".join(f"{m} {p['steps']}" for m, p in profiles.items())
        lines += ["", f"## Where the GPU time goes: {model}", "",
                  f"Milliseconds per step over the steps profiled after the timed ones ({steps}; "
                  f"torch.profiler): the wall time; the median timed step, unprofiled, from the "
                  f"record; all kernels' time, by kind (from the operators that launched "
                  f"them; casts: Inductor's cast-only kernels), and the calls of each kind; "
                  f"the timed step less all kernels: time the GPU spent between kernels "
                  f"or waiting for work; the CPU's wait at the syncs between the profiled "
                  f"steps: the lead its launches had over the GPU (little where a step is "
                  f"launch-bound; the profiler's overhead shortens it), and the same wait "
                  f"closing the timed steps, unprofiled, from the record; the commands per step "
                  f"that put work on the GPU (CUDA runtime and driver calls), with the time "
                  f"outside kernels per command; then the time of "
                  f"the kernels each operator launched itself, for each system's "
                  f"{PROFILE_TOP_OPS} largest. Tables and traces: profiles/<case id>/.", "",
                  "| operator | " + " | ".join(modes) + " |", "|---|" + "---:|" * len(modes)]
        lines += _kind_rows(profiles, timed, waits)
        for name in top:
            cells = [f"{profiles[m]['ops'][name]:.2f}" if name in profiles[m]["ops"] else "-"
                     for m in modes]
            shown = name if len(name) <= 70 else name[:67] + "..."
            lines.append(f"| `{shown}` | " + " | ".join(cells) + " |")
        lines += _copy_lines(profiles)
    return lines


def _copy_lines(profiles: dict) -> list[str]:
    """Each profiled system's largest eager copies (``aten::copy_``: the tensors' shapes,
    destination then source), per step: where a copy comes from is read from what it moved."""
    lines = []
    for mode, p in profiles.items():
        copies = sorted((c for c in p["copies"] if len(c["shapes"]) >= 2),
                        key=lambda c: c["ms"], reverse=True)[:PROFILE_TOP_COPIES]
        if copies:
            lines.append(f"- {mode}: " + "; ".join(
                f"{_shape(c['shapes'][0])} <- {_shape(c['shapes'][1])}: {c['calls']:g} calls, "
                f"{c['ms']:.2f} ms" for c in copies))
    if lines:
        lines = ["", "Eager copies (`aten::copy_`) by the shapes of the tensors, destination "
                 "<- source, per step:", ""] + lines
    return lines


def _shape(shape) -> str:
    return "[" + ", ".join(str(n) for n in shape) + "]"


def run(cfg, out, steps: int, warmup: int, dtype: str, device: str, deadline_s: float,
        timeout_s: float, min_case_s: float, profile_modes=PROFILED_MODES,
        profile_steps: int = PROFILE_STEPS) -> int:
    """Run every case of ``cfg`` not yet settled in ``out``, each for at most ``timeout_s``
    and all of them within ``deadline_s`` seconds; returns how many were left out. Cases of
    ``profile_modes`` run ``profile_steps`` more steps under torch.profiler after their timed
    ones, into ``out/profiles/<case id>/``."""
    from slapo_ae.cfg import parse_cfg
    from slapo_ae.harness import cli
    from slapo_ae.record import RecordError, read_record

    out = Path(out)
    start = time.monotonic()
    skipped = 0
    for case in parse_cfg(cfg):
        record_path = out / f"{case.id}.json"
        try:
            status = read_record(record_path).status
            if status in SETTLED:
                print(f"{case.id}: {status} already, kept", flush=True)
                continue
        except (OSError, RecordError):
            pass
        elapsed = time.monotonic() - start
        left = deadline_s - elapsed
        if left < min_case_s:
            print(f"{case.id}: not started, {max(left, 0):.0f} s of the {deadline_s:g} s "
                  f"deadline left (a case gets at least {min_case_s:g} s)", flush=True)
            skipped += 1
            continue
        run_case = case.for_run(steps, warmup, dtype, device)
        args = ["run", *run_case.to_argv(), "--out", str(record_path),
                "--log", str(out / "logs" / f"{case.id}.log"),
                "--timeout", f"{min(timeout_s, left):.0f}"]
        if profile_steps and case.mode in profile_modes:
            args += ["--profile", str(out / "profiles" / case.id),
                     "--profile-after", str(profile_steps)]
        # `slapo-bench run`: prints "<id>: <status>: <samples/s or reason> -> <record>", and
        # leaves a failed record even when the harness itself breaks.
        cli.main(args)
        print(f"  [{time.monotonic() - start - elapsed:.0f} s; {time.monotonic() - start:.0f} s "
              f"in all]", flush=True)
    return skipped


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slapo_ae.analysis.gpu_check",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="run the cases of a cfg file, then judge them")
    p.add_argument("cfg")
    p.add_argument("--out", required=True, help="folder of the records and the summary")
    p.add_argument("--steps", type=int, default=15, help="all steps, warm-up included")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--dtype", default="bf16", choices=("fp32", "fp16", "bf16"))
    p.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    # Defaults sized for a part of at most 7 minutes (scripts/gpu_check.sh): about 30 s of
    # set-up and 370 s of cases. The parts' cases took 15-100 s each on one H200 (the longest
    # hf-compile's, with its compilation), 270 s for six of a part's seven.
    p.add_argument("--deadline", type=float, default=370.0,
                   help="seconds for all the cases together; a case's timeout is cut to what "
                        "is left (default 370)")
    p.add_argument("--timeout", type=float, default=150.0,
                   help="seconds per case at most (default 150)")
    p.add_argument("--min-case", type=float, default=45.0,
                   help="no case starts with fewer seconds left before the deadline "
                        "(default 45)")
    p.add_argument("--profile-modes", default=",".join(PROFILED_MODES),
                   help="modes profiled after their timed steps, comma-separated (default "
                        f"{','.join(PROFILED_MODES)}; empty: none)")
    p.add_argument("--profile-steps", type=int, default=PROFILE_STEPS,
                   help=f"steps profiled after the timed ones (default {PROFILE_STEPS}; 0: none)")
    p = sub.add_parser("judge", help="judge the records of a folder")
    p.add_argument("folder")
    args = parser.parse_args(argv)
    if args.command == "run":
        from slapo_ae.cfg import CfgError, parse_cfg

        try:  # bad input is refused before any case runs
            parse_cfg(args.cfg)
        except CfgError as err:
            print("\n".join(err.errors), file=sys.stderr)
            return 2
        except OSError as err:
            print(f"{args.cfg}: cannot read: {err.strerror or err}", file=sys.stderr)
            return 2
        if args.profile_steps < 0:
            print(f"--profile-steps must be at least 0, got {args.profile_steps}",
                  file=sys.stderr)
            return 2
        modes = tuple(m for m in args.profile_modes.split(",") if m)
        from slapo_ae.case import MODES

        unknown = [m for m in modes if m not in MODES]
        if unknown:
            print(f"--profile-modes: unknown mode(s) {', '.join(unknown)}; known: "
                  f"{', '.join(MODES)}", file=sys.stderr)
            return 2
        skipped = run(args.cfg, args.out, args.steps, args.warmup, args.dtype, args.device,
                      args.deadline, args.timeout, args.min_case, modes, args.profile_steps)
        folder = args.out
    else:
        skipped = 0
        folder = args.folder
        if not Path(folder).is_dir():
            print(f"{folder}: no such folder of records", file=sys.stderr)
            return 2
    verdicts = judge(folder)
    print(Path(folder, "summary.md").read_text())
    if skipped:
        print(f"{skipped} case(s) not run: the deadline was near", file=sys.stderr)
    # a failed case is a status to look at too: cases that all broke (an import, say) leave
    # NOT-RUN verdicts only
    failed = sorted(r.id for r in load_records(folder).values() if r.status == "failed")
    if failed:
        print(f"{len(failed)} case(s) failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed or any(v.verdict == "FAIL" for v in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
