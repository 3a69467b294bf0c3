"""The autotuner in the workflow (fake harness): each trial is a cached case, the pruning
search's rounds run only the trials it decides from earlier records, the aggregate writes the
CSV, summary, chosen cfg and Figure 10, a second run does nothing, and ``--config tuned=true``
runs the Figure 7 case with the tuned batch and ratio."""
from __future__ import annotations

import json

import plan
import pytest
import yaml
from wf_util import make_config, x_marks

from slapo.autotune import GridSearch, PruningSearch, tune
from slapo_ae.cfg import parse_cfg
from slapo_ae.harness.tune import space_of
from slapo_ae.tuning import load_tuning

pytestmark = pytest.mark.slow

SPEC = """\
case: "slapo-megatron bert-tiny 1 64 0 batch_size ckpt_ratio"
symbols:
  batch_size: {values: [2, 4, 8, 16], memory: increasing}
  ckpt_ratio: {values: [1.0, 0.5, 0.0], memory: decreasing}
strategies: [STRATEGIES]
steps: 2
warmup: 1
memory_per_rank: 4096
"""
TUNED_E2E = "slapo-megatron__bert-tiny__g1__s64__b2__c0"  # the test cfg's case it replaces


def memory(config) -> float:
    return config["batch_size"] * (1.6 - 0.6 * config["ckpt_ratio"])


def value(config) -> float:
    return 10.0 + config["batch_size"] + 5 * (1 - config["ckpt_ratio"])


def setup_tuning(repo, strategies="prune"):
    """The tuning spec in the copy and the fake harness's landscape: a trial needing more
    than 10 'units' of memory is an oom record, the others run at :func:`value`."""
    path = repo.path / "configs" / "autotune" / "test.yaml"
    path.write_text(SPEC.replace("STRATEGIES", strategies))
    spec = load_tuning(path)
    steer = {}
    for case_id, (config, _) in spec.cases().items():
        steer[case_id] = ({"status": "oom", "reason": "out of memory: rank 0: (fake)"}
                          if memory(config) > 10 else {"samples_per_s": value(config)})
    repo.plan(steer)
    config = make_config(repo.path)
    config["profiles"]["test"]["experiments"]["autotune"] = ["configs/autotune/test.yaml"]
    repo.write_config(config)
    return spec


def expected(spec, strategy):
    """What slapo.autotune does in-process on the same landscape."""
    def evaluate(config):
        if memory(config) > 10:
            raise MemoryError("fake")
        return value(config)

    return tune(space_of(spec), evaluate, strategy)


def test_the_pruning_search_runs_its_trials_as_cached_cases(repo):
    spec = setup_tuning(repo)
    want = expected(spec, PruningSearch(along="batch_size"))
    repo.snakemake("results/autotune.csv", "figures/autotune.pdf")
    ran = [t["case_id"] for t in repo.trace()]
    trial_ids = [spec.case_for(t.config).id for t in want.trials]
    assert sorted(ran) == sorted(trial_ids)  # each trial once, no pruned point run
    assert len(ran) < len(spec.points())
    records = {p.stem for p in repo.records("autotune/test")}
    assert records == set(trial_ids)
    oom = [t for t in want.trials if t.status == "oom"]
    assert oom  # the landscape prunes with real oom records
    for trial in oom:
        rec = json.loads(repo.record("autotune/test", spec.case_for(trial.config).id).read_text())
        assert rec["status"] == "oom"

    summary = json.loads((repo.path / "results" / "autotune.json").read_text())["test"]
    assert summary["grid_size"] == 12 and summary["strategies"]["prune"]["trials"] == len(ran)
    assert summary["chosen"]["config"] == want.best.config
    assert summary["chosen"]["samples_per_s"] == want.best.value
    csv = (repo.path / "results" / "autotune.csv").read_text().splitlines()
    assert len(csv) == 1 + 12
    assert sum(",not-run," in row for row in csv) == 12 - len(ran)
    assert (repo.path / "figures" / "autotune.pdf").stat().st_size > 0
    from slapo_ae.analysis.autotune import figure

    assert x_marks(figure({"test": summary})) == len(oom)

    # the chosen configuration as a cfg line that parses back to the tuned case
    cfg = repo.path / "results" / "autotune.cfg"
    (case,) = parse_cfg(cfg)
    assert case.id == spec.case_for(want.best.config).id

    # a second run does nothing; the rounds are the records of the decisions
    assert repo.dry_run("results/autotune.csv", "figures/autotune.pdf") == {}
    rounds = sorted((repo.path / "results/autotune/test/test/prune").glob("round*.json"))
    assert len(rounds) == summary["strategies"]["prune"]["rounds"] + 1


def test_grid_and_pruning_share_their_trials_and_compare(repo):
    spec = setup_tuning(repo, strategies="prune, grid")
    repo.snakemake("results/autotune.json")
    ran = [t["case_id"] for t in repo.trace()]
    assert sorted(ran) == sorted(spec.cases())  # the grid: every point, each once
    summary = json.loads((repo.path / "results" / "autotune.json").read_text())["test"]
    grid = expected(spec, GridSearch())
    comparison = summary["prune_vs_grid"]
    assert comparison["grid_trials"] == 12
    assert comparison["prune_trials"] == len(expected(spec, PruningSearch()).trials)
    assert comparison["found_grid_best"] is True
    assert comparison["grid_best"]["config"] == grid.best.config
    assert summary["chosen"]["strategy"] == "prune"


def test_tuned_true_runs_the_figure7_case_with_the_tuned_batch_and_ratio(repo):
    spec = setup_tuning(repo)
    best = expected(spec, PruningSearch()).best
    tuned = spec.case_for(best.config)
    assert tuned.id != TUNED_E2E
    repo.snakemake("results/e2e.csv", "--config", "tuned=true")
    csv = (repo.path / "results" / "e2e.csv").read_text()
    assert f",{tuned.id}," in csv and f",{TUNED_E2E}," not in csv
    record = json.loads(repo.record("e2e", tuned.id).read_text())
    assert record["status"] == "ok"
    runs = [t for t in repo.trace() if t["case_id"] == tuned.id]
    assert len(runs) == 2  # once as a trial (capped, 2 steps), once as the Figure 7 case
    # the Figure 7 cases in the planned order, the tuned one in the turn of the case it replaced
    settings = plan.resolve(yaml.safe_load((repo.path / "configs" / "config.yaml").read_text()))
    e2e = plan.tuned_e2e(plan.load_cases(settings, repo.path)["e2e"], [tuned])
    priority = plan.run_order({"e2e": e2e})
    ran = [t["case_id"] for t in sorted(repo.trace(), key=lambda t: t["start"])
           if "/e2e/" in t["log"]]
    assert ran == sorted(e2e, key=lambda cid: priority["e2e", cid], reverse=True), ran
    assert repo.dry_run("results/e2e.csv", "--config", "tuned=true") == {}
    # without the switch the cfg's own case is back
    assert TUNED_E2E in repo.pending_cases("results/e2e.csv")


def test_a_bad_tuning_spec_stops_the_workflow_naming_file_and_line(repo):
    setup_tuning(repo)
    path = repo.path / "configs" / "autotune" / "test.yaml"
    path.write_text(path.read_text().replace("memory: decreasing", "memory: sideways"))
    proc = repo.snakemake("-n", check=False)
    assert proc.returncode == 2
    assert "configs/autotune/test.yaml:4: symbols.ckpt_ratio.memory: one of" in proc.stderr
    assert "Traceback" not in proc.stderr
