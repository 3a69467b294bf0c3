"""One case through the workflow with the real harness CLI (slapo-bench run): the runner and
the harness agree on the contract, and the record is a real measurement."""
import pytest
from wf_util import make_config

from slapo_ae.record import read_record

pytestmark = pytest.mark.slow

CASE = "slapo-megatron__bert-tiny__g2__s32__b4__c0"


def test_one_real_case(repo):
    (repo.path / "configs" / "e2e" / "real.cfg").write_text("slapo-megatron bert-tiny 2 32 0 4 0\n")
    config = make_config(repo.path, experiments={"e2e": ["configs/e2e/real.cfg"],
                                                 "ablation": []}, timeout=300)
    config["harness"] = "python -m slapo_ae.harness.cli"
    repo.write_config(config)
    repo.snakemake(f"results/e2e/test/{CASE}.json")
    record = read_record(repo.record("e2e", CASE))
    assert record.status == "ok", record.reason
    assert record.metrics.samples_per_s > 0
    assert record.case["id"] == CASE and record.case["gpus"] == 2
    assert record.env["device_count"] == 0  # CPU ranks
    log = (repo.path / "results" / "e2e" / "test" / "logs" / f"{CASE}.log").read_text()
    assert "# --- slapo_ae.harness.runner ---" in log
    assert repo.dry_run(f"results/e2e/test/{CASE}.json") == {}


def test_ranks_get_one_core_each_whatever_the_environment_says(repo):
    """The job holds the workflow's 4 cores (Snakemake exports OMP_NUM_THREADS=4 to it, and the
    caller said 4 too), its 2 ranks one core each: each must run 1 intra-op and 1 inter-op
    thread."""
    (repo.path / "configs" / "e2e" / "real.cfg").write_text("slapo-megatron bert-tiny 2 32 0 4 0\n")
    config = make_config(repo.path, experiments={"e2e": ["configs/e2e/real.cfg"],
                                                 "ablation": []}, timeout=300)
    config["harness"] = "python -m slapo_ae.harness.cli"
    repo.write_config(config)
    repo.snakemake(f"results/e2e/test/{CASE}.json", "--cores", "4",
                   env_extra={"OMP_NUM_THREADS": "4", "MKL_NUM_THREADS": "4"})
    record = read_record(repo.record("e2e", CASE))
    assert record.status == "ok", record.reason
    env = record.env
    assert (env["cores"], env["ranks"], env["threads_per_rank"]) == (2, 2, 1)
    assert env["interop_threads_per_rank"] == 1
    used = env["threads_in_use"]
    assert len(used) == 2
    for rank in used:
        assert rank["torch_threads"] == 1 and rank["torch_interop_threads"] == 1
        assert rank["omp_num_threads"] == "1"
