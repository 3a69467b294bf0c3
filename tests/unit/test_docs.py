"""The repository's front door, as a reviewer meets it: README.md and docs/*.md name only files
that exist and links that lead somewhere, the Snakemake targets the README names are ones the
workflow knows, no doc points at an issue number, the Makefile says which Python it needs
before it builds anything, and the licence and citation files say what pyproject.toml says."""
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


# -- the interpreter ---------------------------------------------------------------------------
def make(tmp_path, *args):
    """``make -n ARGS`` with a virtual environment that does not exist yet, so that the
    interpreter named by PYTHON is the one checked."""
    return subprocess.run(["make", "-n", "--no-print-directory", f"VENV={tmp_path / 'venv'}",
                           *args], cwd=ROOT, capture_output=True, text=True)


def fake_python(tmp_path, version: str) -> Path:
    path = tmp_path / f"python{version}"
    path.write_text(f"#!/bin/sh\necho {version}\n")
    path.chmod(0o755)
    return path


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
def test_make_stops_at_once_with_one_line_when_python_is_not_3_11(tmp_path):
    done = make(tmp_path, "venv", f"PYTHON={fake_python(tmp_path, '3.12')}")
    assert done.returncode != 0 and not done.stdout  # nothing would have run
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "python3.12 is Python 3.12, but slapo-ae needs Python 3.11" in lines[0]
    assert "make PYTHON=python3.11 <target>" in lines[0]
    for goal in ("reproduce", "test"):
        assert "needs Python 3.11" in make(tmp_path, goal, "PYTHON=/no/such/python").stderr
    missing = make(tmp_path, "venv", "PYTHON=/no/such/python")
    assert "/no/such/python is no Python that runs" in missing.stderr


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
def test_make_goes_on_with_python_3_11_and_cleans_without_any(tmp_path):
    done = make(tmp_path, "venv", f"PYTHON={fake_python(tmp_path, '3.11')}")
    assert done.returncode == 0 and "-m venv" in done.stdout
    assert make(tmp_path, "clean", "PYTHON=/no/such/python").returncode == 0


def test_pyproject_and_readme_agree_on_python_3_11():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=3.11,<3.12"
    assert "Python 3.11" in (ROOT / "README.md").read_text()


# -- licence and citation ----------------------------------------------------------------------
def test_the_license_is_apache_2_0_as_pyproject_says():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == {"text": "Apache-2.0"}
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_the_citation_names_the_artifact_and_the_paper():
    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert cff["cff-version"] == "1.2.0" and cff["type"] == "software"
    assert cff["license"] == "Apache-2.0" and cff["authors"]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert cff["version"] == project["version"]
    paper = cff["preferred-citation"]
    assert paper["title"].startswith("Slapo: A Schedule Language for Progressive Optimization")
    assert [(a["given-names"], a["family-names"]) for a in paper["authors"]] == [
        ("Hongzheng", "Chen"), ("Cody Hao", "Yu"), ("Shuai", "Zheng"), ("Zhen", "Zhang"),
        ("Zhiru", "Zhang"), ("Yida", "Wang")]
    assert paper["year"] == 2024 and "ASPLOS '24" in paper["collection-title"]
    assert "2302.08005" in paper["url"]


# -- the docs ----------------------------------------------------------------------------------
DOCS = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} (.+)$", re.M)
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
# a path of the repository as the docs write it in backticks: under a tracked top-level folder,
# or a top-level file; generated ones (results/, figures/, report.html) are the workflow's
TRACKED = ("slapo/", "slapo_ae/", "configs/", "workflow/", "docs/", "scripts/", "tests/",
           "benchmarks/", "examples/", "docker/")
# results/ may be a volume mounted over the checkout's (the Docker image's documented use),
# which hides the committed reference data that docs link to
RESULTS_MOUNTED = not (ROOT / "results" / "reference").is_dir()
TOP_FILES = ("Snakefile", "Makefile", "pyproject.toml", "LICENSE", "CITATION.cff", "README.md")
CODE_PATH = re.compile(r"`([\w./-]+)`")


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    return {slug(h) for h in HEADING.findall(FENCE.sub("", doc.read_text()))}


@pytest.mark.parametrize("doc", DOCS)
def test_every_relative_link_leads_to_a_file_and_heading_that_exist(doc):
    path = ROOT / doc
    broken = []
    for target in LINK.findall(FENCE.sub("", path.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        where = (path.parent / file).resolve() if file else path
        if RESULTS_MOUNTED and (ROOT / "results") in where.parents:
            continue
        if not where.exists() or ROOT not in where.parents and where != ROOT:
            broken.append(target)
        elif anchor and where.suffix == ".md" and anchor not in anchors(where):
            broken.append(target)
    assert not broken, f"{doc} links to what does not exist"


@pytest.mark.parametrize("doc", DOCS)
def test_every_path_a_doc_names_exists(doc):
    named = {p.rstrip("/") for p in CODE_PATH.findall((ROOT / doc).read_text())
             if p.startswith(TRACKED) or p in TOP_FILES}
    # test files are named by their tier, as tests/README.md does: workflow/test_...py
    missing = sorted(p for p in named if not (ROOT / p).exists()
                     and not (ROOT / "tests" / p).exists())
    assert not missing, f"{doc} names paths that do not exist"


@pytest.mark.parametrize("doc", [*DOCS, "tests/README.md"])
def test_no_doc_points_at_what_a_reader_of_the_repository_cannot_open(doc):
    text = (ROOT / doc).read_text()
    assert not re.search(r"\b[Ii]ssues? #?\d+", text), f"{doc} refers to an issue number"
    assert "REFERENCE.md" not in text, f"{doc} points at a file outside the repository"


def test_no_code_or_config_points_at_the_team_s_notes_outside_the_repository():
    # REFERENCE.md and DESIGN.md are the project team's, not in the repository
    files = [p for folder in TRACKED if folder != "docs/"
             for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".cfg", ".sh", ".yaml",
                                                                ".smk", ".md", "")
             and p.is_file() and "__pycache__" not in p.parts]
    files += [ROOT / name for name in TOP_FILES if (ROOT / name).is_file()]
    this = Path(__file__).resolve()
    named = sorted(str(p.relative_to(ROOT)) for p in files if p.resolve() != this
                   and re.search(r"\b(REFERENCE|DESIGN)\.md", p.read_text(errors="replace")))
    assert not named, f"these name a file outside the repository: {named}"


# -- the Snakemake targets the README names ----------------------------------------------------
# options of snakemake that take a value (the next argument, or several key=value ones)
VALUED = {"--workflow-profile", "--cores", "-c", "--jobs", "-j", "--resources", "--report",
          "--forcerun", "--configfile", "--profile", "--config"}


def snakemake_targets(text: str) -> set[str]:
    """The targets of every `snakemake` command the text names, in code blocks or inline code
    (`snakemake ...` standing for the README's full command)."""
    commands = [line for block in re.findall(r"```\w*\n(.*?)```", text, re.S)
                for line in block.splitlines()]
    commands += re.findall(r"`([^`\n]*snakemake[^`\n]*)`", text)
    targets = set()
    for command in commands:
        words = command.split("#")[0].split()
        at = next((i for i, word in enumerate(words) if word.endswith("snakemake")), None)
        if at is None:
            continue
        args = iter(words[at + 1:])
        for word in args:
            if word in VALUED:
                next(args, None)  # its value (more key=value ones are skipped below)
            elif not (word.startswith("-") or "=" in word or word == "..."):
                targets.add(word)
    return targets


def dry_run(targets) -> subprocess.CompletedProcess:
    """Snakemake's plan for ``targets`` in the cpu profile, changing nothing."""
    return subprocess.run([sys.executable, "-m", "snakemake", *sorted(targets), "--dry-run",
                           "--quiet", "rules", "--nolock", "--cores", "1", "--config",
                           "profile=cpu"], cwd=ROOT, capture_output=True, text=True)


def test_the_readme_names_only_targets_the_workflow_knows():
    targets = snakemake_targets((ROOT / "README.md").read_text())
    assert {"kick_the_tires", "figures/table4.md", "figures/e2e.pdf", "figures/ablation.pdf",
            "results/claims.md"} <= targets
    done = dry_run(targets)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def test_an_unknown_target_fails_the_same_dry_run():
    assert snakemake_targets("`snakemake ... --cores 1 figures/no_such.pdf --config a=b c=d`"
                             ) == {"figures/no_such.pdf"}
    assert dry_run({"figures/no_such.pdf"}).returncode != 0
