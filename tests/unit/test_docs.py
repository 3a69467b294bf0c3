"""The repository's front door, as a reviewer meets it: README.md and docs/*.md name only files
that exist and links that lead somewhere, the Snakemake targets the README names are ones the
workflow knows, no doc points at an issue number, the Makefile says which Python it needs
before it builds anything, and the licence and citation files say what pyproject.toml says."""
import shutil
import subprocess
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
