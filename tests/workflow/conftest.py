"""Fixtures of the workflow tests (helpers in wf_util.py)."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "workflow"))  # the planner

from wf_util import Repo, make_config, make_repo


@pytest.fixture
def repo(tmp_path) -> Repo:
    """A fresh copy of the repository with the test profile; nothing run yet."""
    return make_repo(tmp_path / "repo")


@pytest.fixture(scope="session")
def _completed(tmp_path_factory) -> Path:
    repo = make_repo(tmp_path_factory.mktemp("completed") / "repo")
    repo.snakemake()
    return repo.path


@pytest.fixture
def done_repo(_completed, tmp_path) -> Repo:
    """A copy of a repository where the whole test profile has run (mtimes kept)."""
    dest = tmp_path / "repo"
    shutil.copytree(_completed, dest, symlinks=True)
    repo = Repo(dest)
    repo.write_config(make_config(dest))  # the slot folder of this copy
    # write_config changed config.yaml's mtime: no input depends on it, nothing reruns
    repo.plan({})
    repo.trace_file.unlink(missing_ok=True)
    return repo
