"""Helpers of the workflow tests: a temporary copy of the repository with a tiny ``test``
profile whose cases run through ``tests/workflow/fake_harness.py`` (instant, steerable), and a
helper that runs Snakemake there in a subprocess."""
from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
COPY = ["Snakefile", "workflow", "configs", "slapo", "slapo_ae", "scripts/srun_case.sh",
        "tests/workflow/fake_harness.py"]
IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", ".snakemake")

E2E_CFG = """\
# test profile: Figure 7's four systems on bert-tiny (1 and 2 ranks), two on gpt-neo-tiny
megatron        bert-tiny    1,2 64 0 2*n 0
slapo-megatron  bert-tiny    1,2 64 0 2*n 0
deepspeed       bert-tiny    1,2 64 0 2*n 0
slapo-deepspeed bert-tiny    1,2 64 0 2*n 0
deepspeed       gpt-neo-tiny 1   64 0 2   0
slapo-deepspeed gpt-neo-tiny 1   64 0 2   0
"""
ABLATION_CFG = """\
eager             bert-tiny 1 64 0 2 0
slapo-kernel      bert-tiny 1 64 0 2 0
slapo-tp-attn-ffn bert-tiny 2 64 0 4 0
slapo-tp-full     bert-tiny 2 64 0 4 0
"""
E2E_CASES = 10
ABLATION_CASES = 4


def make_config(tmp: Path, **profile) -> dict:
    settings = {"device": "cpu", "dtype": "fp32", "steps": 3, "warmup": 1, "timeout": 60,
                "max_gpus": 2,
                "experiments": {"e2e": ["configs/e2e/test.cfg"],
                                "ablation": ["configs/ablation/test.cfg"]}}
    settings.update(profile)
    return {"profile": "test", "gpus": 0, "gpu_slots": True,
            "gpu_slots_dir": str(tmp / "slots"),
            "harness": "python tests/workflow/fake_harness.py",
            "profiles": {"test": settings}}


class Repo:
    """A temporary copy of the repository (``path``) with the test profile."""

    def __init__(self, path: Path):
        self.path = path
        self.plan_file = path / "fake_plan.json"
        self.trace_file = path / "fake_trace.jsonl"

    def write_config(self, config: dict) -> None:
        (self.path / "configs" / "config.yaml").write_text(yaml.safe_dump(config))

    def plan(self, plan: dict) -> None:
        """Steer the fake harness (see fake_harness.py)."""
        self.plan_file.write_text(json.dumps(plan))

    def env(self, **extra) -> dict:
        env = dict(os.environ, FAKE_HARNESS_PLAN=str(self.plan_file),
                   FAKE_HARNESS_TRACE=str(self.trace_file), HF_HUB_OFFLINE="1",
                   OMP_NUM_THREADS="1")
        env.update(extra)
        env.pop("CUDA_VISIBLE_DEVICES", None)
        return env

    def command(self, *args, profile=True) -> list[str]:
        cmd = [sys.executable, "-m", "snakemake"]
        if profile:
            cmd += ["--workflow-profile", "workflow/profiles/default", "--cores", "2"]
        return cmd + list(args)

    def snakemake(self, *args, check=True, timeout=600, profile=True, env_extra=None):
        proc = subprocess.run(self.command(*args, profile=profile), cwd=self.path,
                              env=self.env(**(env_extra or {})), capture_output=True, text=True,
                              timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"snakemake {' '.join(args)} failed ({proc.returncode}):\n"
                                 f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
        return proc

    def dry_run(self, *args) -> dict:
        """Jobs a dry run would run: ``{rule: [first output of each job]}``; {} if nothing."""
        proc = self.snakemake("-n", *args)
        return parse_dry_run(proc.stdout + proc.stderr)

    def pending_cases(self, *args) -> set[str]:
        """Case ids a dry run would (re)run."""
        return {Path(out).stem for out in self.dry_run(*args).get("case", [])}

    def record(self, experiment: str, case_id: str, profile: str = "test") -> Path:
        return self.path / "results" / experiment / profile / f"{case_id}.json"

    def records(self, experiment: str, profile: str = "test") -> list[Path]:
        return sorted((self.path / "results" / experiment / profile).glob("*.json"))

    def incomplete(self) -> set[Path]:
        """Outputs Snakemake marked as started but not finished (``.snakemake/incomplete``:
        one file per output, named by the path in URL-safe base64, long names split into
        ``@``-prefixed folders)."""
        root = self.path / ".snakemake" / "incomplete"
        found = set()
        for marker in root.rglob("*") if root.is_dir() else []:
            if marker.is_file() and marker.name != "migration_underway":
                parts = marker.relative_to(root).parts
                encoded = "".join(p.lstrip("@") for p in parts)
                found.add(self.path / base64.urlsafe_b64decode(encoded).decode())
        return found

    def trace(self) -> list[dict]:
        if not self.trace_file.is_file():
            return []
        return [json.loads(line) for line in self.trace_file.read_text().splitlines() if line]


def parse_dry_run(text: str) -> dict:
    """``{rule: [first output of each job]}`` from a dry run's job blocks (``rule all``,
    which has no output, maps to ``[""]``)."""
    jobs, rule = {}, None
    for line in text.splitlines():
        match = re.match(r"^(?:local)?rule (\w+):$", line.strip())
        if match:
            rule = match.group(1)
            jobs.setdefault(rule, [])
            if rule == "all":
                jobs[rule].append("")
            continue
        if rule and line.strip().startswith("output: "):
            jobs[rule].append(line.strip()[len("output: "):].split(", ")[0])
            rule = None
    return jobs


def copy_workflow(dest: Path) -> Path:
    """Copy what the workflow needs to run (Snakefile, workflow/, configs/, slapo/ and the fake
    harness) from this repository into ``dest``; also used by benchmarks/bench_workflow.py."""
    dest.mkdir(parents=True, exist_ok=True)
    for rel in COPY:
        src = REPO / rel
        if src.is_dir():
            shutil.copytree(src, dest / rel, ignore=IGNORE)
        else:
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def make_repo(dest: Path) -> Repo:
    copy_workflow(dest)
    (dest / "configs" / "e2e" / "test.cfg").write_text(E2E_CFG)
    (dest / "configs" / "ablation" / "test.cfg").write_text(ABLATION_CFG)
    repo = Repo(dest)
    repo.write_config(make_config(dest))
    repo.plan({})
    return repo


def x_marks(fig) -> int:
    """How many X marks (non-``ok`` cases) a figure of ``slapo_ae.analysis.plots`` draws
    (legends aside)."""
    return sum(1 for ax in fig.axes for line in ax.lines if line.get_marker() == "x")


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def stop_group(pid: int) -> None:
    """SIGKILL the process group led by ``pid``, if it is still there."""
    import signal

    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
