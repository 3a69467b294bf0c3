"""Cases as Slurm jobs: three real CPU cases (the harness CLI, tiny BERT on 1 and 2 ranks)
submitted through ``workflow/profiles/slurm-local`` to a running Slurm cluster, then the
aggregate CSV; a case on two "nodes" through ``scripts/srun_case.sh`` by hand, and one as a
workflow job of two tasks. Needs the cluster
of ``scripts/slurm_local.sh start`` (``.ci/run`` starts it); skips, saying why, where none
answers."""
import importlib.util
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from wf_util import make_config

from slapo_ae.record import read_record

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

PARTITION = "local"  # the partition of scripts/slurm_local.sh and of the slurm-local profile
CFG = """\
megatron       bert-tiny 1   32 0 4 0
slapo-megatron bert-tiny 1,2 32 0 4 0
"""
CASES = ["megatron__bert-tiny__g1__s32__b4__c0", "slapo-megatron__bert-tiny__g1__s32__b4__c0",
         "slapo-megatron__bert-tiny__g2__s32__b4__c0"]
START = "start one with `bash scripts/slurm_local.sh start`"
REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _query(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1][:200] if lines else ""


def _why_no_cluster() -> str | None:
    """Why the test cannot run here, or None."""
    if importlib.util.find_spec("snakemake_executor_plugin_slurm") is None:
        return "snakemake-executor-plugin-slurm is not installed (the `slurm` extra)"
    if not shutil.which("sbatch"):
        return f"no Slurm here (no sbatch); {START}"
    nodes = _query("sinfo", "-h", "-p", PARTITION, "-o", "%t")
    if nodes.returncode != 0 or not nodes.stdout.strip():
        return f"no Slurm cluster with partition {PARTITION!r} answers " \
               f"({_last_line(nodes.stderr) or 'no nodes'}); {START}"
    accounting = _query("sacct", "-n", "-X", "-S", "now")
    if accounting.returncode != 0:
        return f"the cluster keeps no job accounting ({_last_line(accounting.stderr)}): " \
               "the executor plugin would never learn that a job ended"
    return None


@pytest.fixture(scope="module")
def cluster():
    reason = _why_no_cluster()
    if reason:
        pytest.skip(reason)


def test_cases_run_as_slurm_jobs(cluster, repo):
    (repo.path / "configs" / "e2e" / "slurm.cfg").write_text(CFG)
    config = make_config(repo.path, experiments={"e2e": ["configs/e2e/slurm.cfg"],
                                                 "ablation": []}, timeout=300)
    config["harness"] = "python -m slapo_ae.harness.cli"
    repo.write_config(config)
    cmd = [sys.executable, "-m", "snakemake", "--workflow-profile",
           "workflow/profiles/slurm-local", "results/e2e.csv"]
    proc = subprocess.run(cmd, cwd=repo.path, env=repo.env(), capture_output=True, text=True,
                          timeout=540)  # under pytest's 600 s
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"

    # every case ran as a Slurm job (Snakemake names each job's Slurm id and log), and the
    # cluster's accounting says it completed
    submitted = re.findall(
        r"SLURM jobid (\d+) \(log: \S*/slurm_logs/rule_(\w+)/(?:(\S+)/)?\d+\.log",
        proc.stdout + proc.stderr)
    jobs = {name.removeprefix("e2e_test_"): job for job, rule, name in submitted
            if rule == "case"}
    assert sorted(jobs) == sorted(CASES), submitted
    assert [rule for _, rule, _ in submitted].count("e2e_table") == 1  # the aggregate too
    states = _query("sacct", "-n", "-X", "-P", "-o", "JobID,State,Partition",
                    "-j", ",".join(jobs.values()))
    assert states.returncode == 0, states.stderr
    rows = {line.split("|")[0]: line.split("|")[1:] for line in states.stdout.splitlines()}
    for case_id, job in jobs.items():
        assert rows.get(job) == ["COMPLETED", PARTITION], (case_id, job, states.stdout)

    # the records are real measurements, each of the case the cfg line says
    for case_id in CASES:
        record = read_record(repo.record("e2e", case_id))
        assert record.status == "ok", f"{case_id}: {record.reason}"
        assert record.case["id"] == case_id
        assert record.metrics.samples_per_s > 0
        assert record.env["ranks"] == record.case["gpus"]
        assert record.env["device_count"] == 0  # CPU ranks

    table = pd.read_csv(repo.path / "results" / "e2e.csv")
    assert sorted(table["case_id"]) == sorted(CASES)
    assert set(table["status"]) == {"ok"}
    assert (table["samples_per_s"] > 0).all()
    # Snakemake's bookkeeping is the same as for local runs: nothing left to do
    assert repo.dry_run("results/e2e.csv") == {}


def test_a_case_on_two_nodes_runs_through_srun(cluster, tmp_path):
    """``scripts/srun_case.sh``: one slapo-bench per node through srun, one c10d rendezvous.
    The local cluster has one machine, so the case's two "nodes" are two tasks on it."""
    out = tmp_path / "record.json"
    job = _query("sbatch", "--parsable", "--wait", "--partition", PARTITION, "--ntasks", "2",
                 "--cpus-per-task", "1", "--mem-per-cpu", "1000", "--time", "10",
                 "--output", str(tmp_path / "slurm-%j.out"), "--export",
                 f"ALL,SLAPO_CASE_NODES=2,SLAPO_RDZV_PORT={_free_port()},HF_HUB_OFFLINE=1",
                 "--wrap", f"{REPO / 'scripts' / 'srun_case.sh'} --device cpu --mode eager "
                 "--model bert-tiny --gpus 2 --seq-len 16 --batch-size 4 --steps 3 --warmup 1 "
                 f"--cores 1 --timeout 300 --out {out}")
    log = "\n".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))
    assert job.returncode == 0, f"{job.stderr}\n{log[-3000:]}"
    record = read_record(out)
    assert record.status == "ok", record.reason
    assert (record.case["nodes"], record.case["gpus_per_node"]) == (2, 1)
    assert len(record.metrics.peak_mem_bytes) == 2  # both agents' ranks reported
    # both tasks finished: the one with rank 0 wrote the record, the other found it there
    assert log.count(f"-> {out}") == 2, log[-3000:]


MULTINODE_CASE = "deepspeed__gpt-neo-tiny__g4__n2__s32__b8__c0"


def test_a_case_on_two_nodes_runs_as_one_slurm_job(cluster, repo):
    """A profile of 2 ranks per node makes a 4-rank case a case on 2 nodes: one Slurm job of
    2 tasks (`max_job_nodes: 1` of slurm-local: both on the one machine), whose runner starts
    one agent per task through scripts/srun_case.sh; one record with both agents' ranks."""
    (repo.path / "configs" / "multinode").mkdir(exist_ok=True)
    (repo.path / "configs" / "multinode" / "slurm.cfg").write_text(
        "deepspeed gpt-neo-tiny 4 32 0 8 0\n")
    config = make_config(repo.path, gpus_per_node=2, max_gpus=4, timeout=300, experiments={
        "e2e": [], "ablation": [], "multinode": ["configs/multinode/slurm.cfg"]})
    config["harness"] = "python -m slapo_ae.harness.cli"
    repo.write_config(config)
    cmd = [sys.executable, "-m", "snakemake", "--workflow-profile",
           "workflow/profiles/slurm-local", f"results/multinode/test/{MULTINODE_CASE}.json"]
    proc = subprocess.run(cmd, cwd=repo.path, env=repo.env(), capture_output=True, text=True,
                          timeout=540)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    job = re.findall(r"SLURM jobid (\d+) \(log: \S*/slurm_logs/rule_case/", proc.stdout +
                     proc.stderr)
    assert len(job) == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    states = _query("sacct", "-n", "-X", "-P", "-o", "State,NNodes,AllocTRES", "-j", job[0])
    state, nodes, tres = states.stdout.strip().splitlines()[0].split("|")
    assert (state, nodes) == ("COMPLETED", "1") and "cpu=2" in tres, states.stdout
    record = read_record(repo.record("multinode", MULTINODE_CASE))
    assert record.status == "ok", record.reason
    assert (record.case["nodes"], record.case["gpus_per_node"]) == (2, 2)
    assert len(record.metrics.peak_mem_bytes) == 4  # both agents' ranks reported
    log = (repo.path / "results" / "multinode" / "test" / "logs" /
           f"{MULTINODE_CASE}.log").read_text()
    assert "2 nodes of 2 ranks, via srun" in log and "srun_case.sh" in log
