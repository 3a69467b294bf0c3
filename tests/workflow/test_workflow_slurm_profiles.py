"""The Slurm profiles (workflow/profiles/slurm, slurm-local) as Snakemake reads them: their
workflow settings are valid config, and survive a `--config` on the command line (which
replaces a profile's own `config:` list as a whole). No cluster needed."""
import importlib.util
import os
import re
import subprocess
import sys

import plan
import pytest
import yaml
from wf_util import REPO, copy_workflow

PROFILES = ["slurm", "slurm-local"]


@pytest.mark.parametrize("name", PROFILES)
def test_site_settings_are_valid_config(name):
    profile = yaml.safe_load((REPO / "workflow" / "profiles" / name / "config.yaml").read_text())
    assert profile["executor"] == "slurm"
    assert "config" not in profile  # a --config on the command line would drop it
    config = yaml.safe_load((REPO / "configs" / "config.yaml").read_text())
    for path in profile["configfile"]:
        site = yaml.safe_load((REPO / path).read_text())
        assert site["gpu_slots"] is False  # a boolean, not the string "false"
        config.update(site)
    plan.check_config(config, REPO / "workflow" / "schemas" / "config.schema.yaml")


@pytest.mark.skipif(importlib.util.find_spec("snakemake_executor_plugin_slurm") is None,
                    reason="snakemake-executor-plugin-slurm is not installed (the `slurm` extra)")
def test_paper_profile_through_the_slurm_profile(tmp_path):
    """A dry run on a login node without GPUs: `--config profile=paper` keeps the site's
    settings, so a 4-GPU case asks for 4 GPUs and half the node's 64 cores on partition gpu."""
    copy_workflow(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "results/e2e.csv", "--workflow-profile",
         "workflow/profiles/slurm", "-n", "--config", "profile=paper"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    jobs = re.findall(r"wildcards: experiment=e2e, profile=paper, case_id=(\S+)\n"
                      r"(?:\s*priority: \d+\n)?"  # the run order (plan.run_order)
                      r"\s*threads: (\d+)\n\s*resources: (.*)", proc.stdout + proc.stderr)
    assert len(jobs) > 10
    for case_id, threads, resources in jobs:
        gpus = int(re.search(r"__g(\d+)__", case_id).group(1))
        assert int(threads) == 64 * gpus // 8, (case_id, threads)  # --cpus-per-task
        assert f"gpu={gpus}," in resources, (case_id, resources)
        assert f"rank_cores={64 * gpus // 8}" in resources, (case_id, resources)
        assert "slurm_partition=gpu" in resources


class _Resources(dict):
    """A job's resources as the Slurm executor plugin reads them (``.get`` and attributes)."""

    def __getattr__(self, name):
        return self[name]


def _resources(text: str) -> dict:
    found = {}
    for item in text.split(", "):
        key, _, value = item.partition("=")
        found[key] = int(value) if value.isdigit() else value
    return found


@pytest.mark.skipif(importlib.util.find_spec("snakemake_executor_plugin_slurm") is None,
                    reason="snakemake-executor-plugin-slurm is not installed (the `slurm` extra)")
def test_multinode_profile_asks_slurm_for_the_nodes(tmp_path):
    """Figure 8's profile through the Slurm profile (a dry run): each case job asks for its
    nodes with one task per node's agent, a node's cores for each, and the GPUs per machine;
    the plugin's own submit code turns that into the sbatch options a multi-node job needs, and
    `mpi` keeps its job step from wrapping the command in `srun -n1`."""
    from types import SimpleNamespace

    from snakemake_executor_plugin_slurm.submit_string import get_submit_command
    from snakemake_executor_plugin_slurm.utils import set_gres_string

    copy_workflow(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "results/multinode.csv", "--workflow-profile",
         "workflow/profiles/slurm", "-n", "--config", "profile=multinode"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    jobs = re.findall(r"wildcards: experiment=multinode, profile=multinode, case_id=(\S+)\n"
                      r"(?:\s*priority: \d+\n)?"  # the run order (plan.run_order)
                      r"\s*threads: (\d+)\n\s*resources: (.*)", proc.stdout + proc.stderr)
    assert len(jobs) == 18
    params = {"run_uuid": "u", "slurm_logfile": "l", "comment_str": "c", "account": "",
              "partition": "-p gpu", "workdir": ""}
    for case_id, threads, text in jobs:
        nodes = int(re.search(r"__n(\d+)__", case_id).group(1))
        resources = _resources(text)
        assert int(threads) == 64, case_id  # one node's cores for each node's agent
        assert {k: resources.get(k) for k in ("nodes", "tasks", "mpi", "gres")} == {
            "nodes": nodes, "tasks": nodes, "mpi": "srun", "gres": "gpu:8"}, case_id
        assert "gpu" not in resources  # asked per machine, not as a job total
        job = SimpleNamespace(resources=_Resources(resources), threads=int(threads))
        sbatch = get_submit_command(job, params) + set_gres_string(job)
        for option in (f"--nodes={nodes}", f"--ntasks={nodes}", "--cpus-per-task=64",
                       "--gres=gpu:8"):
            assert option in sbatch, (option, sbatch)
        assert "--ntasks-per-gpu" not in sbatch and "--gpus=" not in sbatch, sbatch
