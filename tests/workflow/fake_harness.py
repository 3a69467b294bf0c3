"""A stand-in for the harness CLI in the workflow's tests: same arguments, instant records.

    python tests/workflow/fake_harness.py run --mode M --model X ... --out REC.json --log L

It writes a valid record at once, with a made-up throughput that depends only on the case
(so tests can predict the figures and claims), and exits as the harness does: with the exit
status of the record's status (``slapo_ae.harness.cli.EXIT_STATUS``). What it does per case
is steered by the JSON file named in ``$FAKE_HARNESS_PLAN``, keyed by case id, mode or
``"*"`` (and ``"node<i>"`` for agent ``i`` of a case on several nodes, applied last)::

    {"<case-id>": {"sleep": 5, "status": "failed", "reason": "...", "crash": true,
                   "samples_per_s": 3.0}}

``crash``: exit 1 without a record, as a harness that broke would (the runner must then
record the failure); ``linger``:
seconds to wait after writing the record, as the harness does while its ranks shut down. Every call
appends one JSON line ``{case_id, start, end, cuda_visible_devices, pid, rdzv_endpoint, log}``
to ``$FAKE_HARNESS_TRACE`` when that is set (used to check GPU packing and the agents of a
case on several nodes). Of those agents, the one given the case's own log (the runner's
first; the others log to ``*.node<i>.log``) writes the record, as rank 0's node does.

These records are test fixtures, never published results.
"""
import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the copy's slapo_ae

from slapo_ae import case as case_options  # noqa: E402
from slapo_ae.harness.cli import EXIT_STATUS  # noqa: E402
from slapo_ae.record import Record, write_record  # noqa: E402

RATES = {"megatron": 10.0, "deepspeed": 12.0, "slapo-megatron": 15.0, "slapo-deepspeed": 14.0,
         "eager": 5.0, "slapo-kernel": 7.0, "slapo-tp-attn-ffn": 9.0, "slapo-tp-full": 11.0}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["run"])
    case_options.add_arguments(parser)  # the real harness's case options
    for flag in ("--out", "--log", "--case-id", "--rdzv-endpoint"):
        parser.add_argument(flag, required=flag == "--out")
    for flag in ("--timeout", "--cores"):
        parser.add_argument(flag, type=float, default=0)
    parser.add_argument("--profile")  # accepted, ignored: the fake writes no profile
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    case = case_options.from_args(args, args.device)
    args.case_id = args.case_id or case.id
    plan = {}
    if os.environ.get("FAKE_HARNESS_PLAN"):
        plan = json.loads(Path(os.environ["FAKE_HARNESS_PLAN"]).read_text())
    node = re.search(r"\.node(\d+)$", Path(args.log or "").stem)
    node = int(node.group(1)) if node else 0
    todo = {**plan.get("*", {}), **plan.get(args.mode, {}), **plan.get(args.case_id, {}),
            **(plan.get(f"node{node}", {}) if case.nodes > 1 else {})}
    start = time.time()
    if args.log:
        with open(args.log, "a") as log:
            log.write(f"fake harness pid {os.getpid()}: {args.case_id} plan {todo}\n")
    time.sleep(float(todo.get("sleep", 0)))
    end = time.time()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if os.environ.get("FAKE_HARNESS_TRACE"):
        with open(os.environ["FAKE_HARNESS_TRACE"], "a") as trace:
            trace.write(json.dumps({"case_id": args.case_id, "gpus": args.gpus, "start": start,
                                    "end": end, "cuda_visible_devices": visible,
                                    "pid": os.getpid(), "rdzv_endpoint": args.rdzv_endpoint,
                                    "log": args.log}) + "\n")
    if todo.get("crash"):
        print("fake harness: crashing as planned", file=sys.stderr)
        return 1
    if case.nodes > 1 and node > 0:
        print("fake harness: this node's ranks finished; the node of rank 0 writes the record")
        return 0
    status = todo.get("status", "ok")
    rate = todo.get("samples_per_s", RATES.get(args.mode, 1.0) * args.gpus)
    record_case = case.to_record(args.case_id)
    metrics = {"samples_per_s": rate if status == "ok" else None,
               "spread": {"min": rate * 0.9, "max": rate * 1.1, "q1": rate, "q3": rate,
                          "iqr": 0.0, "stdev": 0.0, "steps": args.steps - args.warmup},
               "step_times": [case.batch_size / rate] * args.steps if status == "ok" else [],
               "warmup_steps": args.warmup}
    env = {"device_name": "FakeGPU" if visible else "cpu (fake)",
           "device_count": args.gpus if visible else 0, "hostname": "testhost",
           "torch": "fake", "cuda_visible_devices": visible}
    write_record(Record(status=status, case=record_case, reason=todo.get("reason", ""),
                        metrics=metrics, env=env, log_path=args.log), args.out)
    time.sleep(float(todo.get("linger", 0)))
    return EXIT_STATUS[status]


if __name__ == "__main__":
    sys.exit(main())
