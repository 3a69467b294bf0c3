"""One round of a tuning in the workflow: from the trials recorded so far, the next trials.

    python -m slapo_ae.harness.tune --spec configs/autotune/cpu_tiny.yaml --strategy prune \\
        --round 2 --records results/autotune/cpu_tiny/cpu \\
        --previous results/autotune/cpu_tiny/cpu/prune/round1.json \\
        --out results/autotune/cpu_tiny/cpu/prune/round2.json

Each trial is a benchmark case whose record (``<records>/<case-id>.json``) the workflow's
``case`` rule makes and caches. Round ``k`` reads round ``k - 1`` (the trials so far and the
ones it asked for, now recorded), turns the records into :class:`slapo.autotune.Trial`\\ s
(status as recorded, samples/s as the value), and asks the strategy of :mod:`slapo.autotune`
what to run next. The round file lists every trial so far, the next ones, and once the
strategy proposes nothing, ``done`` and the best trial (:func:`slapo.autotune.best`)::

    {"tuning": ..., "strategy": "prune", "round": 2, "spec": ..., "records": ..., "grid_size": 12,
     "trials": [{"case_id", "config", "round", "status", "samples_per_s"}, ...],
     "next": [{"case_id", "config"}, ...], "done": false, "best": null}

The decision is a pure function of the spec and the records, so a rerun decides the same, and
an interrupted tuning resumes from its records. This module is the artifact's one user of
``slapo.autotune`` (which loads torch, as ``import slapo`` does): the planner itself only
reads the round files.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from slapo_ae import atomic
from slapo_ae.record import RecordError, read_record
from slapo_ae.tuning import TuningError, TuningSpec, load_tuning


def space_of(spec: TuningSpec):
    """The :class:`slapo.autotune.Space` of a spec: its symbols and constraints."""
    from slapo.autotune import Space

    space = Space()
    for symbol in spec.symbols:
        space.create_symbol(symbol.name, symbol.values, memory=symbol.memory)
    for text in spec.constraints:
        space.add_constraint(lambda config, text=text: spec.satisfies_one(text, config), text)
    return space


def strategy_of(spec: TuningSpec, name: str):
    from slapo.autotune import GridSearch, PruningSearch

    if name == "grid":
        return GridSearch()
    return PruningSearch(along=spec.along, parallel=spec.parallel)


def recorded(entry: dict, records: Path) -> dict:
    """A trial entry completed from its record: status and samples/s."""
    path = records / f"{entry['case_id']}.json"
    try:
        record = read_record(path)
    except (OSError, RecordError) as err:
        raise RecordError(f"{path}: the record of trial {entry['config']}: {err}") from None
    value = record.metrics.samples_per_s if record.status == "ok" else None
    return {**entry, "status": record.status, "samples_per_s": value}


def decide(spec: TuningSpec, strategy: str, round_no: int, previous: dict | None,
           records: Path) -> dict:
    """The round file of round ``round_no`` (see the module docstring)."""
    from slapo.autotune import Trial, best

    entries = []
    if previous is not None:
        entries = list(previous["trials"])
        entries += [recorded({**e, "round": previous["round"]}, records)
                    for e in previous["next"]]
    trials = [Trial(e["config"], e["status"], e["samples_per_s"]) for e in entries]
    space = space_of(spec)
    proposals = strategy_of(spec, strategy).propose(space, trials)
    cases = {space.key(config): spec.case_for(config).id for config in space.configs()}
    top = best(trials, space) if not proposals else None
    return {
        "tuning": spec.name, "strategy": strategy, "round": round_no, "spec": spec.path,
        "records": str(records), "grid_size": len(cases),
        "trials": entries,
        "next": [{"case_id": cases[space.key(c)], "config": c} for c in proposals],
        "done": not proposals,
        "best": None if top is None else {"case_id": cases[space.key(top.config)],
                                          "config": top.config, "samples_per_s": top.value},
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Decide the next round of a tuning.")
    parser.add_argument("--spec", required=True, help="the tuning spec (YAML)")
    parser.add_argument("--strategy", required=True, choices=("prune", "grid"))
    parser.add_argument("--round", type=int, required=True, dest="round_no")
    parser.add_argument("--records", required=True, help="folder of the trials' records")
    parser.add_argument("--previous", default=None, help="the round file before this one")
    parser.add_argument("--out", required=True, help="this round's file (JSON)")
    args = parser.parse_args(argv)
    if (args.previous is None) != (args.round_no == 0):
        parser.error("--previous is given exactly when --round is above 0")
    try:
        spec = load_tuning(args.spec)
        previous = json.loads(Path(args.previous).read_text()) if args.previous else None
        result = decide(spec, args.strategy, args.round_no, previous, Path(args.records))
    except (TuningError, RecordError, OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    atomic.write_text(args.out, json.dumps(result, indent=1) + "\n")
    what = (f"done after {len(result['trials'])} trials, best {result['best']}"
            if result["done"] else f"next: {[e['case_id'] for e in result['next']]}")
    print(f"{spec.name} {args.strategy} round {args.round_no}: {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
