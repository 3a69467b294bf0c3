"""``slapo-bench``: the benchmark harness's command line (also ``python -m slapo_ae.harness.cli``).

    slapo-bench cases CFG [--max-gpus N] [--format text|json]
    slapo-bench run --mode M --model NAME --gpus N --seq-len S [--dec-seq-len D]
                    --batch-size B [--ckpt C] --steps K --warmup W [--dtype fp32|fp16|bf16]
                    --out PATH.json [--log PATH] [--timeout S] [--case-id ID] [--device ...]
                    [--seed N] [--lr X] [--no-dropout] [--override KEY=VALUE ...]
                    [--cores C] [--profile DIR [--profile-after N]]

``cases`` expands a cfg file into its cases, or exits 2 with ``file:line: message`` lines.
``run`` runs one case on N ranks and writes its record; its exit status says the record's
status (:data:`EXIT_STATUS`: 0 only for ``ok``), 2 a usage error (no record), 128 + signal
an interruption (one line, no traceback; the ranks are stopped). See docs/harness.md.

A Ctrl-C ends in that one line from the moment this module runs: it imports only what the
interpreter has already loaded, and :func:`main` imports the rest inside its guard.
"""
from __future__ import annotations

import itertools
import os
import signal
import sys
from pathlib import Path

EXIT_USAGE = 2
# the exit status of `run` by the status of the record it wrote: a script (or a shell's `&&`)
# tells ok from not ok by it alone. 1 is left to Python (an error of the harness itself that
# left no record) and 2 to usage errors (argparse's too).
EXIT_STATUS = {"ok": 0, "failed": 3, "oom": 4, "unsupported": 5}


class UsageError(Exception):
    pass


def _known_models() -> list[str]:
    from slapo_ae.zoo.configs import list_models

    return list_models()


# -- cases ------------------------------------------------------------------------------
def cmd_cases(args) -> int:
    from slapo_ae import cfg as _cfg

    try:
        found = _cfg.parse_cfg(args.cfg, max_gpus=args.max_gpus,
                               known_models=None if args.no_model_check else _known_models())
    except _cfg.CfgError as err:
        for line in err.errors:
            print(line, file=sys.stderr)
        return EXIT_USAGE
    except OSError as err:
        print(f"{args.cfg}: cannot read: {err.strerror or err}", file=sys.stderr)
        return EXIT_USAGE
    if args.format == "json":
        import json

        json.dump([case.to_record() for case in found], sys.stdout, indent=2)
        print()
    else:
        for case in found:
            print(f"{case.id}\t{_cfg.to_cfg_line(case)}\t# {case.where}")
    return 0


# -- run --------------------------------------------------------------------------------
def _resolve_device(choice: str) -> str:
    if choice != "auto":
        return choice
    from slapo_ae import gpus

    return "cuda" if gpus.visible_gpus() else "cpu"


def spec_from_args(args):
    """Validate the ``run`` options into a :class:`RunSpec` (``UsageError`` on bad input)."""
    import math

    from slapo_ae import case as _case
    from slapo_ae.harness.runspec import RunSpec, default_timeout
    from slapo_ae.harness.threads import default_cores
    from slapo_ae.zoo import configs

    try:
        case = _case.from_args(args, _resolve_device(args.device))
        configs.load_config(case.model)
        configs.check_seq_len(case.model, case.seq_len, case.overrides)
        configs.check_dec_seq_len(case.model, case.dec_seq_len)
    except _case.CaseError as err:
        raise UsageError(str(err)) from None
    except KeyError as err:
        raise UsageError(err.args[0]) from None
    except ValueError as err:
        raise UsageError(str(err)) from None
    if case.overrides:
        from slapo_ae.zoo import hf_config

        try:
            hf_config(case.model, **case.overrides)
        except Exception as err:  # the model's config refuses a field or a value of it
            raise UsageError(f"--override: {' '.join(str(err).split())}") from None
    out = Path(args.out)
    timeout = (args.timeout if args.timeout is not None
               else default_timeout(case.device, case.steps))
    if not (math.isfinite(timeout) and timeout > 0):
        raise UsageError(f"--timeout must be a positive number of seconds, got {timeout}")
    if case.nodes > 1 and not args.rdzv_endpoint:
        raise UsageError(f"--nodes {case.nodes} needs --rdzv-endpoint HOST:PORT (the same on "
                         "every node: where their torchrun agents meet)")
    if case.nodes == 1 and args.rdzv_endpoint:
        raise UsageError("--rdzv-endpoint is for a case on several nodes (--nodes)")
    if args.rdzv_endpoint:
        host, _, port = args.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise UsageError(f"--rdzv-endpoint {args.rdzv_endpoint!r}: expected HOST:PORT, "
                             "a port from 1 to 65535")
    cores = (args.cores if args.cores is not None
             else default_cores(case.device, case.gpus_per_node))
    if cores < 1:
        raise UsageError(f"--cores must be at least 1, got {cores}")
    from slapo_ae.harness.threads import available_cores

    # A CPU rank stands for a GPU and holds a core by default, more ranks than cores included
    # (cpu_rank_limit bounds those); a rank given more threads than the machine has cores
    # would only time-share them.
    threads_per_rank = max(1, cores // case.gpus_per_node)
    if threads_per_rank > available_cores():
        raise UsageError(f"--cores {cores}: {threads_per_rank} threads for each of the "
                         f"{case.gpus_per_node} ranks, more than this machine's "
                         f"{available_cores()} cores")
    if args.profile_after < 0:
        raise UsageError(f"--profile-after must be at least 0, got {args.profile_after}")
    if args.profile_after and not args.profile:
        raise UsageError("--profile-after needs --profile DIR (where the profile goes)")
    if not out.name:
        raise UsageError("--out must name the record's file, got an empty path")
    log = args.log or str(out.with_suffix(".log"))
    for flag, path in (("--out", out), ("--log", Path(log))):
        if path.is_dir():
            raise UsageError(f"{flag}: {path} is a folder, not a file")
    # three places a run writes: none may be another, or one is lost
    places = {"--out": out.resolve(), "--log": Path(log).resolve()}
    if args.profile:
        places["--profile"] = Path(args.profile).resolve()
    for (flag_a, a), (flag_b, b) in itertools.combinations(places.items(), 2):
        if a == b:
            raise UsageError(f"{flag_a} and {flag_b} name the same place ({a}): the run would "
                             "write one over the other")
    for flag, folder in (("--out", out.parent), ("--log", Path(log).parent),
                         ("--profile", Path(args.profile) if args.profile else None)):
        if folder is not None:
            _writable(flag, folder)
    memory = case.memory_per_rank * 2**20 if case.memory_per_rank else None
    return RunSpec(case=case, out=str(out), log=log, timeout=float(timeout),
                   case_id=args.case_id, cores=cores, memory_per_rank=memory,
                   profile_dir=args.profile, profile_after=args.profile_after,
                   rdzv_endpoint=args.rdzv_endpoint)


def _writable(flag: str, folder: Path) -> None:
    """Refuse a folder the run could not write its results to, before anything runs."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"{flag}: cannot create {folder}: {err.strerror or err}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"{flag}: {folder} is not writable")


def cmd_run(args) -> int:
    from slapo_ae.harness.supervise import Interrupted

    spec = None
    try:
        from slapo_ae.harness import launch

        spec = spec_from_args(args)
        try:
            record = launch.run(spec)
        except Exception as err:  # the harness's own bug or environment: still leave a record
            import traceback

            from slapo_ae.record import write_record

            traceback.print_exc()
            record = spec.non_ok_record("failed", f"harness error: {type(err).__name__}: {err}\n"
                                                  f"{traceback.format_exc()}")
            write_record(record, spec.out)
    except UsageError as err:
        print(f"slapo-bench run: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt as err:  # no rank runs: before the launch, or after it
        return interrupted("slapo-bench run", getattr(err, "signum", signal.SIGINT), spec)
    except Interrupted as err:  # a stop signal while the ranks ran: the supervisor stopped them
        return interrupted("slapo-bench run", err.signum, spec, ranks_stopped=True)
    if record is None:
        if not args.quiet:
            print(f"{spec.case_dict()['id']}: this node's ranks finished; the node of rank 0 "
                  "writes the record")
        return 0
    if not args.quiet:
        m = record.metrics
        what = (f"{m.samples_per_s:.3f} samples/s" if record.status == "ok"
                else record.reason.splitlines()[0] if record.reason else "")
        print(f"{record.id}: {record.status}: {what} -> {spec.out}")
    return EXIT_STATUS[record.status]


def interrupted(prog: str, signum: int, spec=None, ranks_stopped: bool = False) -> int:
    """Say in one line what an interruption left behind; the exit status 128 + ``signum``."""
    if spec is None or spec.launch_time is None:
        when = " before any rank started"
    else:
        when = "; its ranks were stopped" if ranks_stopped else ""
    written = None
    if spec is not None:
        from slapo_ae.harness.launch import own_record

        # a record this launch wrote before the interruption is a finished result
        written = spec.out if own_record(spec) is not None else None
    left = f"its record {written} was written before" if written else "no record written"
    print(f"{prog}: interrupted{when}; {left}", file=sys.stderr)
    return 128 + signum


# -- parser -----------------------------------------------------------------------------
def build_parser():
    import argparse

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
    from slapo_ae import case as _case

    _case.add_arguments(p)
    p.add_argument("--out", required=True, help="record path (.json), written atomically")
    p.add_argument("--log", default=None, help="log of all ranks (default: OUT with .log)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds before the ranks are killed (default: 1800 on GPU, "
                        "600 + 120 per step on CPU)")
    p.add_argument("--case-id", default=None, help="the id stored in the record's case")
    p.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                   help="with --nodes > 1: where the nodes' torchrun agents meet (a port "
                        "free on HOST, the same on every node; HOST is usually the first node)")
    p.add_argument("--cores", type=int, default=None,
                   help="CPU cores the case holds; each of its ranks runs max(1, CORES // "
                        "ranks) threads, whatever OMP_NUM_THREADS says (default: one per rank "
                        "on CPU, where a rank stands for a GPU; all available on CUDA)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="profile the timed steps with torch.profiler: each rank writes its "
                        "operator table and trace to DIR (slows the run; the record says so)")
    p.add_argument("--profile-after", type=int, default=0, metavar="N",
                   help="with --profile: profile N more steps after the timed ones instead, "
                        "so that the record's figures come from unprofiled steps")
    p.add_argument("--quiet", action="store_true", help="print nothing on success")
    p.set_defaults(func=cmd_run)
    return parser


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP while no rank runs, handled as a Ctrl-C: a file being written is
    removed (slapo_ae/atomic.py), where the default action would leave its temporary behind.
    The case runner stops the other agents of a case on several nodes this way when one of
    them exits with a status other than 0. While the ranks run, the supervisor's own handlers
    stop them first (slapo_ae/harness/supervise.py)."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum


def _stop(signum, frame):
    raise Stopped(signum)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except KeyboardInterrupt as err:  # while the program starts, or while `cases` reads
        signum = getattr(err, "signum", signal.SIGINT)
        if argv[:1] == ["run"]:
            return interrupted("slapo-bench run", signum)
        print("slapo-bench: interrupted", file=sys.stderr)
        return 128 + signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
