"""``slapo-bench``: the benchmark harness's command line (also ``python -m slapo.bench.cli``).

    slapo-bench cases CFG [--max-gpus N] [--format text|json]
    slapo-bench run --mode M --model NAME --gpus N --seq-len S [--dec-seq-len D]
                    --batch-size B [--ckpt C] --steps K --warmup W [--dtype fp32|fp16|bf16]
                    --out PATH.json [--log PATH] [--timeout S] [--case-id ID] [--device ...]
                    [--seed N] [--lr X] [--no-dropout] [--override KEY=VALUE ...]
                    [--cores C] [--profile DIR]

``cases`` expands a cfg file into its cases, or exits 2 with ``file:line: message`` lines.
``run`` runs one case on N ranks and writes its record; it exits 0 whenever a record was
written (whatever its status), 2 on a usage error (no record), 128+signal when interrupted.
See docs/harness.md.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from slapo.bench import cases as _cases
from slapo.bench import expr as _expr
from slapo.bench.runspec import DEFAULT_LR, DEFAULT_SEED, DTYPES, RunSpec, default_timeout
from slapo.bench.threads import default_cores

EXIT_USAGE = 2


class UsageError(Exception):
    pass


def _known_models() -> list[str]:
    from slapo.models import list_models

    return list_models()


# -- cases ------------------------------------------------------------------------------
def cmd_cases(args) -> int:
    try:
        found = _cases.parse_cfg(args.cfg, max_gpus=args.max_gpus,
                                 known_models=None if args.no_model_check else _known_models())
    except _cases.CfgError as err:
        for line in err.errors:
            print(line, file=sys.stderr)
        return EXIT_USAGE
    except OSError as err:
        print(f"{args.cfg}: cannot read: {err.strerror or err}", file=sys.stderr)
        return EXIT_USAGE
    if args.format == "json":
        json.dump([case.to_dict() for case in found], sys.stdout, indent=2)
        print()
    else:
        for case in found:
            print(f"{case.id}\t{_cases.to_cfg_line(case)}\t# {case.where}")
    return 0


# -- run --------------------------------------------------------------------------------
def _parse_override(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise UsageError(f"--override {text!r}: expected KEY=VALUE")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def _resolve_device(choice: str) -> str:
    if choice != "auto":
        return choice
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def spec_from_args(args) -> RunSpec:
    """Validate the ``run`` options into a :class:`RunSpec` (``UsageError`` on bad input)."""
    if args.mode not in _cases.MODES:
        raise UsageError(f"unknown mode {args.mode!r}; known: {', '.join(_cases.MODES)}")
    try:
        from slapo.models import load_config

        load_config(args.model)
    except KeyError as err:
        raise UsageError(err.args[0]) from None
    except ValueError as err:
        raise UsageError(str(err)) from None
    if args.gpus < 1:
        raise UsageError(f"--gpus must be at least 1, got {args.gpus}")
    if args.seq_len < 1 or args.dec_seq_len < 0:
        raise UsageError("--seq-len must be >= 1 and --dec-seq-len >= 0")
    if args.warmup < 0 or args.steps <= args.warmup:
        raise UsageError(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}) >= 0: "
                         "steps count every step, warm-up ones included")
    try:
        batch = _expr.batch_size(args.batch_size, args.gpus)
    except _expr.ExpressionError as err:
        raise UsageError(f"--batch-size: {err}") from None
    try:
        ckpt = _cases.parse_ckpt(args.mode, args.ckpt)
    except ValueError as err:
        raise UsageError(f"--ckpt: {err}") from None
    overrides = dict(_parse_override(o) for o in args.override)
    if overrides:
        from slapo.models import hf_config

        try:
            hf_config(args.model, **overrides)
        except TypeError as err:
            raise UsageError(f"--override: {err}") from None
    device = _resolve_device(args.device)
    out = Path(args.out)
    timeout = args.timeout if args.timeout is not None else default_timeout(device, args.steps)
    if timeout <= 0:
        raise UsageError(f"--timeout must be positive, got {timeout}")
    cores = args.cores if args.cores is not None else default_cores(device, args.gpus)
    if cores < 1:
        raise UsageError(f"--cores must be at least 1, got {cores}")
    return RunSpec(mode=args.mode, model=args.model, gpus=args.gpus, seq_len=args.seq_len,
                   dec_seq_len=args.dec_seq_len, batch_size=batch, batch_expr=args.batch_size,
                   ckpt=ckpt, steps=args.steps, warmup=args.warmup, dtype=args.dtype,
                   device=device, out=str(out), log=args.log or str(out.with_suffix(".log")),
                   timeout=float(timeout), case_id=args.case_id, seed=args.seed, lr=args.lr,
                   no_dropout=args.no_dropout, overrides=overrides, cores=cores,
                   profile_dir=args.profile)


def cmd_run(args) -> int:
    from slapo.bench.launch import run_case

    try:
        spec = spec_from_args(args)
    except UsageError as err:
        print(f"slapo-bench run: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    try:
        record = run_case(spec)
    except Exception as err:  # the harness's own bug or environment: still leave a record
        import traceback

        from slapo.bench.launch import parent_record
        from slapo.bench.record import write_record

        traceback.print_exc()
        record = parent_record(spec, "failed", f"harness error: {type(err).__name__}: {err}\n"
                                               f"{traceback.format_exc()}")
        write_record(record, spec.out)
    if not args.quiet:
        m = record.metrics
        what = (f"{m.samples_per_s:.3f} samples/s" if record.status == "ok"
                else record.reason.splitlines()[0] if record.reason else "")
        print(f"{record.id}: {record.status}: {what} -> {spec.out}")
    return 0


# -- parser -----------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slapo-bench", description="Slapo artifact-evaluation benchmark harness")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("cases", help="expand a cfg file into its cases")
    p.add_argument("cfg", help="cfg file, one case a line (MODE MODEL GPUS SEQ_LEN DEC_SEQ_LEN "
                               "BATCH_SIZE CKPT)")
    p.add_argument("--max-gpus", type=int, default=None,
                   help="GPUs present: bounds 'pow2' (required when a line uses it)")
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.add_argument("--no-model-check", action="store_true",
                   help="do not check model names against configs/models")
    p.set_defaults(func=cmd_cases)

    p = sub.add_parser("run", help="run one case on N ranks and write its record")
    p.add_argument("--mode", required=True, help=f"one of: {', '.join(_cases.MODES)}")
    p.add_argument("--model", required=True, help="model name of configs/models")
    p.add_argument("--gpus", type=int, required=True, help="GPUs (ranks on a CPU machine)")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--dec-seq-len", type=int, default=0)
    p.add_argument("--batch-size", required=True,
                   help="global batch: an integer or an expression in n (the GPU count)")
    p.add_argument("--ckpt", default="0",
                   help="megatron: full | selective | 0; others: ratio of layers in [0, 1]")
    p.add_argument("--steps", type=int, required=True, help="all steps, warm-up included")
    p.add_argument("--warmup", type=int, required=True,
                   help="leading steps left out of the throughput")
    p.add_argument("--dtype", choices=DTYPES, default="fp32",
                   help="fp32 (default; the only one on CPU), or 16-bit mixed precision on GPU")
    p.add_argument("--out", required=True, help="record path (.json), written atomically")
    p.add_argument("--log", default=None, help="log of all ranks (default: OUT with .log)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds before the ranks are killed (default: 1800 on GPU, "
                        "600 + 120 per step on CPU)")
    p.add_argument("--case-id", default=None, help="the id stored in the record's case")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED,
                   help="weights and synthetic data (same on every rank)")
    p.add_argument("--lr", type=float, default=DEFAULT_LR, help="AdamW learning rate")
    p.add_argument("--no-dropout", action="store_true",
                   help="switch every dropout off (for loss comparisons; the paper trains "
                        "with the models' dropout)")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="model config field (VALUE parsed as JSON when it can be)")
    p.add_argument("--cores", type=int, default=None,
                   help="CPU cores the case holds; each of its ranks runs max(1, CORES // "
                        "ranks) threads, whatever OMP_NUM_THREADS says (default: one per rank "
                        "on CPU, where a rank stands for a GPU; all available on CUDA)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="profile the timed steps with torch.profiler: each rank writes its "
                        "operator table and trace to DIR (slows the run; the record says so)")
    p.add_argument("--quiet", action="store_true", help="print nothing on success")
    p.set_defaults(func=cmd_run)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
