"""The two floors: the schedule language loads none of the artifact, the artifact's planning and
analysis modules load no torch, and the sources each analysis step declares are the modules it
imports (what the workflow reruns depends on it). And the map of the house: the docs name
only files that exist, and docs/architecture.md says where every module belongs."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from slapo_ae import sources

LIGHT = ["slapo_ae.case", "slapo_ae.cfg", "slapo_ae.record", "slapo_ae.atomic", "slapo_ae.gpus",
         "slapo_ae.sources", "slapo_ae.zoo", "slapo_ae.zoo.configs", "slapo_ae.harness.cli",
         "slapo_ae.harness.runner", "slapo_ae.harness.launch", "slapo_ae.harness.systems",
         "slapo_ae.analysis.aggregate", "slapo_ae.analysis.plots", "slapo_ae.analysis.claims",
         "slapo_ae.analysis.gaps", "slapo_ae.analysis.recheck", "slapo_ae.analysis.table4",
         "slapo_ae.analysis.kick", "slapo_ae.analysis.gpu_check", "slapo_ae.tuning",
         "slapo_ae.analysis.autotune"]


def loaded_after(imports: list[str]) -> set[str]:
    code = (f"import sys\nfor name in {imports!r}: __import__(name)\n"
            "import json; print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    return set(json.loads(out.stdout))


def test_the_schedule_language_loads_no_artifact_and_no_framework():
    loaded = loaded_after(["slapo"])
    tops = {name.split(".")[0] for name in loaded}
    assert not tops & {"deepspeed", "megatron", "snakemake", "pandas", "slapo_ae"}
    assert "torch" in tops


def test_planning_and_analysis_load_no_torch():
    tops = {name.split(".")[0] for name in loaded_after(LIGHT)}
    assert not tops & {"torch", "slapo", "transformers", "deepspeed", "megatron"}


def test_the_harness_parent_decides_an_unsupported_case_without_torch(tmp_path):
    """The parent checks a case before it launches ranks (systems/support.py); importing
    torch for that cost about 2 s a case. An unsupported case is recorded, and still no torch."""
    out = tmp_path / "r.json"
    code = (
        "import sys\n"
        "from slapo_ae.case import Case\n"
        "from slapo_ae.harness import launch\n"
        "from slapo_ae.harness.runspec import RunSpec\n"
        "case = Case(mode='megatron', model='opt-tiny', gpus=1, seq_len=16, dec_seq_len=0,\n"
        "            batch_size=4, batch_expr='4', ckpt=None, steps=3, warmup=1)\n"
        f"record = launch.run(RunSpec(case=case, out={str(out)!r}))\n"
        "print(record.status, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert done.stdout.split() == ["unsupported", "False"]
    assert "Megatron-LM has no OPT model" in json.loads(out.read_text())["reason"]


@pytest.mark.parametrize("step", sorted(sources.ANALYSIS_STEPS))
def test_each_analysis_step_declares_the_modules_it_imports(step):
    loaded = loaded_after([f"slapo_ae.analysis.{step}"])
    files = {name.removeprefix("slapo_ae.").replace(".", "/") for name in loaded
             if name.startswith("slapo_ae.")}
    packages = {"analysis", "zoo", "harness"}  # their __init__ files hold docstrings only
    declared = set(sources.ANALYSIS_STEPS[step])
    if step in sources.RERUNS_CASES:  # it runs cases: the case code is its input as well
        code = {f.removeprefix("slapo_ae/").removesuffix(".py") for f in sources.case_code()}
        declared |= code
    assert files - packages <= declared, f"{step} imports undeclared modules"
    assert set(sources.ANALYSIS_STEPS[step]) <= files


ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/architecture.md", "tests/README.md")
# a path of the two packages as the docs write it, brace lists included: slapo/op/{gelu,sdpa}.py
NAMED = re.compile(r"`((?:slapo|slapo_ae)/[\w/]*(?:\{[\w,]+\})?[\w.]*)`")


def named_paths(doc: str) -> set[str]:
    found = set()
    for path in NAMED.findall((ROOT / doc).read_text()):
        head, brace, tail = re.fullmatch(r"([^{]*)(?:\{([\w,]+)\})?(.*)", path).groups()
        found |= {head + name + tail for name in brace.split(",")} if brace else {path}
    return found


@pytest.mark.parametrize("doc", DOCS)
def test_the_docs_name_only_files_that_exist(doc):
    missing = sorted(p for p in named_paths(doc) if "<" not in p and not (ROOT / p).exists())
    assert not missing, f"{doc} names files that do not exist"


def test_the_architecture_names_every_module_of_both_packages():
    # a module counts as named by its path, or by its folder (`slapo/op/`, `primitives/<name>.py`)
    text = (ROOT / "docs/architecture.md").read_text()
    named = named_paths("docs/architecture.md")
    folders = {p.rstrip("/") for p in named if p.endswith("/")} - {"slapo", "slapo_ae"}
    folders |= set(re.findall(r"`((?:slapo|slapo_ae)/[\w/]+)/<\w+>\.py`", text))
    modules = [p.relative_to(ROOT).as_posix() for package in ("slapo", "slapo_ae")
               for p in (ROOT / package).rglob("*.py") if p.name != "__init__.py"]
    unnamed = sorted(m for m in modules
                     if m not in named and not any(m.startswith(f + "/") for f in folders))
    assert not unnamed, "docs/architecture.md does not say where these belong"
