"""Tuning specs (slapo_ae.tuning): the points and their cases, and every malformed spec
refused with file:line; the shipped specs; the constraint evaluator; the memory cap as a case
field."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from slapo_ae import expr
from slapo_ae.case import Case
from slapo_ae.tuning import TuningError, load_tuning
from slapo_ae.zoo.configs import list_models

REPO = Path(__file__).resolve().parents[2]
SPEC = """\
case: "slapo-deepspeed bert-tiny 2 128 0 batch_size ckpt_ratio"
symbols:
  batch_size: {from: 4, to: 16, step: 2, memory: increasing}
  ckpt_ratio: {values: [1.0, 0.5], memory: decreasing}
constraints:
  - "batch_size % n == 0"
strategies: [prune, grid]
steps: 3
warmup: 1
memory_per_rank: 1024
"""


def write(tmp_path, text, name="t.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_spec_gives_its_points_and_their_cases(tmp_path):
    spec = load_tuning(write(tmp_path, SPEC), known_models=list_models())
    assert spec.name == "t" and spec.strategies == ("prune", "grid")
    assert spec.along == "batch_size" and spec.parallel == 1
    points = spec.points()
    assert [p["batch_size"] for p in points[::2]] == [4, 6, 8, 10, 12, 14, 16]
    assert points[:2] == [{"batch_size": 4, "ckpt_ratio": 1.0},
                          {"batch_size": 4, "ckpt_ratio": 0.5}]
    case = spec.case_for({"batch_size": 8, "ckpt_ratio": 0.5})
    assert case.id == "slapo-deepspeed__bert-tiny__g2__s128__b8__c0.5"
    assert case.memory_per_rank == 1024 and case.line == 1
    assert len(spec.cases()) == len(points) == 14


@pytest.mark.parametrize("change, where, message", [
    (("strategies: [prune, grid]", "strategies: [prune, grids]"), 7, "strategies"),
    (("memory_per_rank: 1024", "memory_per_rnk: 1024"), 10, "unknown key"),
    (("from: 4, to: 16, step: 2", "from: 16, to: 4, step: 2"), 3, "is empty"),
    (("values: [1.0, 0.5]", "values: [1.0, 1.0]"), 4, "listed twice"),
    (("memory: decreasing", "memory: down"), 4, "increasing, decreasing"),
    (('"batch_size % n == 0"', '"__import__(\'os\') == 0"'), 6, "not allowed"),
    (('"batch_size % n == 0"', '"ckpt > 0"'), 6, "the name 'ckpt'"),
    (("batch_size ckpt_ratio\"", "batch_size ratio\""), 1, "CKPT 'ratio' is no symbol"),
    (("bert-tiny", "bert-tinyy"), 1, "unknown model"),
    (("bert-tiny 2", "bert-tiny 1,2"), 1, "one GPU count"),
    (("warmup: 1", "warmup: 3"), 9, "below steps"),
    # what slapo-bench run would refuse for every trial (case.MAX_STEPS, MAX_MEMORY_PER_RANK)
    (("steps: 3", "steps: 99999999999"), 8, "steps: an integer of 1 to 1000000"),
    (("memory_per_rank: 1024", "memory_per_rank: 99999999999999999999"), 10,
     "memory_per_rank: an integer of 1 to 8796093022207"),
])
def test_a_malformed_spec_is_refused_naming_file_and_line(tmp_path, change, where, message):
    path = write(tmp_path, SPEC.replace(*change))
    with pytest.raises(TuningError) as err:
        load_tuning(path, known_models=list_models())
    assert str(err.value).startswith(f"{path}:{where}: "), str(err.value)
    assert message in str(err.value)


def test_a_point_whose_case_is_invalid_needs_a_constraint(tmp_path):
    text = SPEC.replace("step: 2", "step: 1")  # odd batches: not divisible over 2 ranks
    assert len(load_tuning(write(tmp_path, text)).points()) == 14  # the constraint skips them
    path = write(tmp_path, text.replace('constraints:\n  - "batch_size % n == 0"\n', ""))
    with pytest.raises(TuningError) as err:
        load_tuning(path)
    assert str(err.value).startswith(f"{path}:1: the point {{'batch_size': 5, 'ckpt_ratio': 1.0}}")
    assert "not divisible" in str(err.value) and "constraint" in str(err.value)


def test_broken_yaml_and_missing_keys_name_the_file(tmp_path):
    with pytest.raises(TuningError, match=r"t.yaml:\d+: not valid YAML"):
        load_tuning(write(tmp_path, "case: x\nsymbols: [\n"))
    with pytest.raises(TuningError, match="missing key 'symbols'"):
        load_tuning(write(tmp_path, "case: x\n"))
    with pytest.raises(TuningError, match="the pruning search runs along this symbol"):
        load_tuning(write(tmp_path, SPEC.replace("memory: increasing", "memory: null")))


def test_the_shipped_specs_load(tmp_path):
    paper = load_tuning(REPO / "configs/autotune/wideresnet_2.4B_g4.yaml", list_models())
    assert len(paper.points()) == 13 * 7  # batch 96..192 by 8 x 7 ratios, all divisible by 4
    assert paper.template.model == "wideresnet-2.4B" and paper.template.gpus == 4
    assert paper.case_for({"batch_size": 144, "ckpt_ratio": 0.5}).id == \
        "slapo-deepspeed__wideresnet-2.4B__g4__s1__b144__c0.5"
    cpu = load_tuning(REPO / "configs/autotune/cpu_tiny.yaml", list_models())
    assert cpu.memory_per_rank and cpu.strategies == ("prune",)
    assert len(cpu.points()) <= 8  # a handful of trials: the cpu profile stays fast


def test_constraints_evaluate_only_the_names_given():
    assert expr.evaluate_in("batch_size % n == 0", {"batch_size": 12, "n": 4}) is True
    assert expr.evaluate_in("min(b, 8) * n", {"b": 10, "n": 2}) == 16
    with pytest.raises(expr.ExpressionError, match="the name 'x' is not allowed"):
        expr.evaluate_in("x + 1", {"b": 1})
    with pytest.raises(expr.ExpressionError, match="with b=1, n=0: ZeroDivisionError"):
        expr.evaluate_in("b % n", {"b": 1, "n": 0})
    assert expr.evaluate("2*n", 3) == 6  # the batch expressions as before


def test_the_memory_cap_travels_with_the_case_and_only_when_set():
    case = Case(mode="eager", model="bert-tiny", gpus=1, seq_len=16, dec_seq_len=0,
                batch_size=2, batch_expr="2", ckpt=None).for_run(3, 1, "fp32", "cpu")
    assert "memory_per_rank" not in json.loads(case.to_json())  # the jobs as before
    assert "--memory-per-rank" not in case.to_argv()
    import dataclasses

    capped = dataclasses.replace(case, memory_per_rank=512)
    assert Case.from_json(capped.to_json()) == capped
    argv = capped.to_argv()
    assert argv[argv.index("--memory-per-rank") + 1] == "512"
