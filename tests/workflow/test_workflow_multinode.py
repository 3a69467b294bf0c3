"""Cases on several nodes as workflow jobs: the profile's gpus_per_node spreads a case over its
nodes, each node's torchrun agent runs on this machine (``nodes_via: local``), one record per
case, then Figure 8 (results/multinode.csv, figures/multinode.pdf) and C2's multi-node half.
With the fake harness (steerable, instant), then the ``cpu-multinode`` profile for real."""
import json

import pandas as pd
import pytest
import yaml
from wf_util import REPO, make_config, x_marks

from slapo_ae.record import read_record

pytestmark = pytest.mark.slow

CFG = """\
megatron       gpt-neo-tiny 4 64 0 8 0
deepspeed      gpt-neo-tiny 4 64 0 8 0
slapo-megatron gpt-neo-tiny 4 64 0 8 0
"""
CASES = ["megatron__gpt-neo-tiny__g4__n2__s64__b8__c0",
         "deepspeed__gpt-neo-tiny__g4__n2__s64__b8__c0",
         "slapo-megatron__gpt-neo-tiny__g4__n2__s64__b8__c0"]


def _multinode_repo(repo):
    (repo.path / "configs" / "multinode").mkdir(exist_ok=True)
    (repo.path / "configs" / "multinode" / "test.cfg").write_text(CFG)
    repo.write_config(make_config(repo.path, gpus_per_node=2, max_gpus=4, experiments={
        "e2e": [], "ablation": [], "multinode": ["configs/multinode/test.cfg"]}))
    return repo


def test_cases_on_two_nodes_run_as_jobs_and_make_figure8(repo):
    _multinode_repo(repo)
    dry = repo.snakemake("-n")
    jobs = dry.stdout + dry.stderr
    assert jobs.count("nodes=2") == len(CASES)  # each case job asks for its nodes
    assert "mpi=" not in jobs and "tasks=" not in jobs  # local agents: no Slurm tasks
    repo.snakemake()
    assert sorted(p.stem for p in repo.records("multinode")) == sorted(CASES)
    for case_id in CASES:
        record = read_record(repo.record("multinode", case_id))
        assert record.status == "ok" and record.case["nodes"] == 2
        assert record.case["gpus_per_node"] == 2
    agents = repo.trace()
    assert len(agents) == 2 * len(CASES)  # one harness (torchrun agent) per node
    for case_id in CASES:
        mine = [a for a in agents if a["case_id"] == case_id]
        assert len({a["rdzv_endpoint"] for a in mine}) == 1 and len(mine) == 2
    table = pd.read_csv(repo.path / "results" / "multinode.csv")
    assert sorted(table["case_id"]) == sorted(CASES) and set(table["nodes"]) == {2}
    assert (repo.path / "figures" / "multinode.pdf").read_bytes()[:4] == b"%PDF"
    c2 = json.loads((repo.path / "results" / "claims.json").read_text())["claims"][1]
    # the fake harness: Slapo 15 x 4 samples/s against DeepSpeed's 12 x 4
    assert c2["multi_node"]["verdict"] == "PASS"
    assert c2["multi_node"]["measured_max"] == pytest.approx(1.25)
    assert c2["single_node"]["verdict"] == "NOT-RUN"
    assert repo.dry_run() == {}


def test_a_failing_node_is_an_x_in_figure8(repo):
    """The second node's agent of every case crashes while the first waits: each case is a
    failed record (the runner stopped the waiting agent), an X in Figure 8, and C2's
    multi-node half is NOT-RUN."""
    from slapo_ae.analysis import plots

    _multinode_repo(repo)
    repo.plan({"*": {"sleep": 5}, "node1": {"sleep": 0, "crash": True}})
    repo.snakemake()
    for case_id in CASES:
        failed = read_record(repo.record("multinode", case_id))
        assert failed.status == "failed" and "exited with code 1" in failed.reason
    assert x_marks(plots.figure8(pd.read_csv(repo.path / "results" / "multinode.csv"))) == 3
    c2 = json.loads((repo.path / "results" / "claims.json").read_text())["claims"][1]
    assert c2["multi_node"]["verdict"] == "NOT-RUN"


@pytest.mark.timeout(1800)
def test_cpu_multinode_profile_end_to_end(repo):
    """The shipped ``cpu-multinode`` profile with the real harness: 6 cases of 2 nodes x 2 CPU
    ranks, every one a real measurement, then the CSV, Figure 8 and the claims."""
    config = yaml.safe_load((REPO / "configs" / "config.yaml").read_text())
    config.update(profile="cpu-multinode", gpus=0)
    repo.write_config(config)
    repo.snakemake(timeout=1700)
    records = repo.records("multinode", "cpu-multinode")
    assert len(records) == 6
    for path in records:
        record = read_record(path)
        assert record.status == "ok", f"{path.stem}: {record.reason}"
        assert (record.case["nodes"], record.case["gpus_per_node"]) == (2, 2)
        assert record.metrics.samples_per_s > 0
        assert len(record.metrics.peak_mem_bytes) == 4  # both nodes' ranks reported
    table = pd.read_csv(repo.path / "results" / "multinode.csv")
    assert len(table) == 6 and set(table["status"]) == {"ok"}
    assert (repo.path / "figures" / "multinode.pdf").read_bytes()[:4] == b"%PDF"
    c2 = json.loads((repo.path / "results" / "claims.json").read_text())["claims"][1]
    assert c2["multi_node"]["verdict"] != "NOT-RUN"
    assert {p["model"] for p in c2["points"]} == {"gpt-neo-tiny", "llama-tiny"}
    assert all(p["speedup"] > 0 for p in c2["points"])
    assert repo.dry_run() == {}
