"""The Makefile's entry point checks the config options it passes to Snakemake, which parses
them before the workflow could (``snakemake --config profile`` ends in Snakemake's own
traceback): one line per problem, exit status 2, and Snakemake never starts."""
import re
import subprocess
import sys
from pathlib import Path

import check_args
import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("words", [
    [],
    ["--config", "profile=paper", "gpus=8", "--resources", "gpus=8"],
    ["--config=profile=cpu", "-Ctuned=true", "kick_the_tires"],
    ["--config", 'profiles={"cpu":{"steps":6}}', "--", "all"],
    ["--cores", "2", "--config", "harness=python -m slapo_ae.harness.cli"],
    ["--configfile", "configs/config.yaml"],
])
def test_options_snakemake_parses_pass(words):
    assert check_args.problems(words) == []


@pytest.mark.parametrize("words, message", [
    (["--config", "profile"], "--config profile: an entry is KEY=VALUE (e.g. --config "
                              "profile=cpu); --config reads every word up to the next option, "
                              "so put targets before it"),
    # a target after --config is read as one of its entries
    (["--config", "profile=cpu", "kick_the_tires"], "--config kick_the_tires: an entry is"),
    (["-C", "9lives=1"], "--config 9lives=1: '9lives' is not a config key"),
    (["--config=profile"], "--config profile: an entry is KEY=VALUE"),
])
def test_config_entries_snakemake_cannot_parse_are_named(words, message):
    found = check_args.problems(words)
    assert len(found) == 1 and found[0].startswith(message), found


def test_a_configfile_that_is_not_text_or_yaml_is_named(tmp_path):
    binary, broken = tmp_path / "binary.yaml", tmp_path / "broken.yaml"
    binary.write_bytes(b"profile: cpu\n\xff\n")
    broken.write_text("profile: [cpu\n")
    found = check_args.problems(["--configfile", str(binary), str(broken)])
    assert found[0] == (f"--configfile {binary}: not UTF-8 text: byte 0xff at offset 13 cannot "
                        "be decoded (invalid start byte)")
    assert found[1].startswith(f"--configfile {broken}:2:") and "not valid YAML" in found[1]


def _make_reproduce(args: str) -> subprocess.CompletedProcess:
    """``make reproduce SNAKEMAKE_ARGS=args`` with this interpreter and Snakemake replaced by
    ``echo``: the recipe runs as written, no workflow does."""
    return subprocess.run(["make", "-s", "reproduce", f"SNAKEMAKE_ARGS={args}",
                           f"PY={sys.executable}", "STAMP=Makefile", "VENV_PATH=",
                           "SNAKEMAKE=echo SNAKEMAKE"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_make_reproduce_refuses_a_config_without_value_before_snakemake():
    proc = _make_reproduce("--config profile")
    assert proc.returncode == 2 and "SNAKEMAKE" not in proc.stdout
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["error: --config profile: an entry is KEY=VALUE (e.g. --config "
                      "profile=cpu); --config reads every word up to the next option, so put "
                      "targets before it"]


def test_make_reproduce_passes_good_options_on():
    proc = _make_reproduce("--config profile=paper --resources gpus=8")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == ("SNAKEMAKE --report report.html --config "
                                            "profile=paper --resources gpus=8")
    # the GPU count in one word, so that targets may follow it; the user's --resources wins
    run = proc.stdout.splitlines()[-2]
    assert re.fullmatch(r"SNAKEMAKE --resources=gpus=\d+ --config profile=paper --resources "
                        r"gpus=8", run), run
    proc = _make_reproduce("figures/table4.md")
    assert re.fullmatch(r"SNAKEMAKE --resources=gpus=\d+ figures/table4.md",
                        proc.stdout.splitlines()[-2]), proc.stdout
