"""3D parallelism in the harness: ``slapo-megatron`` and ``megatron`` with pipeline stages,
tensor parallelism inside them and data-parallel replicas, on 4 CPU ranks (real torchrun
launches), and the cases they cannot run recorded as ``unsupported`` before any launch.

- ``slapo-megatron`` pipeline 2 x tensor 2, a tiny LLaMA and a tiny GPT-Neo, and data 2 x
  pipeline 2 (GPT-Neo): ok records whose case and metrics say the layout (pp, tp, dp, the
  micro-batch and their count). The LLaMA's losses follow ``eager``'s (the plain HF model,
  DDP over 2 ranks) on the same seed, batches and AdamW steps, dropout off: every step to a
  relative 1e-5, as the TP test of test_harness_systems.py (the pipeline's loss is the mean
  of its micro-batches' vocabulary-parallel cross entropies, the plain model's its HF loss).
  The gradients themselves are compared with the plain model's in
  tests/static/test_static_3d.py, on the same schedule (vocabulary-sharded, kernels on).
- ``megatron`` pipeline 2 x tensor 2 (LLaMA) and data 2 x pipeline 2 (GPT-Neo, its tied
  embedding in both stages): megatron-core's own pipeline schedule on gloo, ok records; and
  data 2 x tensor 2 (LLaMA), whose losses follow tensor 2 alone on 2 ranks to 1e-5 (the
  same weights: megatron-core draws them alike without a pipeline).

The launches run once per module (each 30 to 120 s on a loaded 2-core machine), hence
``slow``.
"""
from __future__ import annotations

import math

import pytest
from harness_util import run_case

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3000)]

LOSS_RTOL = 1e-5
RUN = ["--seq-len", "16", "--batch-size", "8", "--steps", "3", "--warmup", "1", "--no-dropout"]
CASES = {  # name: (options, expected (pp, tp, dp, micro_batch, n_microbatches))
    "slapo-llama-pp2-tp2": (["--mode", "slapo-megatron", "--model", "llama-tiny", "--gpus", "4",
                             "--pp", "2", "--tp", "2"], (2, 2, 1, 4, 2)),
    "slapo-neo-pp2-tp2": (["--mode", "slapo-megatron", "--model", "gpt-neo-tiny", "--gpus",
                           "4", "--pp", "2", "--micro-batch", "2"], (2, 2, 1, 2, 4)),
    "slapo-neo-dp2-pp2": (["--mode", "slapo-megatron", "--model", "gpt-neo-tiny", "--gpus",
                           "4", "--pp", "2", "--tp", "1"], (2, 1, 2, 2, 2)),
    "megatron-llama-pp2-tp2": (["--mode", "megatron", "--model", "llama-tiny", "--gpus", "4",
                                "--pp", "2", "--tp", "2"], (2, 2, 1, 4, 2)),
    "megatron-neo-dp2-pp2": (["--mode", "megatron", "--model", "gpt-neo-tiny", "--gpus", "4",
                              "--pp", "2", "--tp", "1"], (2, 1, 2, 2, 2)),
    "megatron-llama-dp2-tp2": (["--mode", "megatron", "--model", "llama-tiny", "--gpus", "4",
                                "--tp", "2"], (1, 2, 2, 4, 1)),
}
PLAIN = {"eager-llama": ["--mode", "eager", "--model", "llama-tiny", "--gpus", "2"],
         "megatron-llama-tp2": ["--mode", "megatron", "--model", "llama-tiny", "--gpus", "2"]}


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    root = tmp_path_factory.mktemp("records")
    out = {name: run_case(root / f"{name}.json", *args, *RUN)[1]
           for name, (args, _) in CASES.items()}
    for name, args in PLAIN.items():
        out[name] = run_case(root / f"{name}.json", *args, *RUN)[1]
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_3d_case_writes_an_ok_record_with_its_layout(records, name):
    record = records[name]
    assert record.status == "ok", record.reason
    pp, tp, dp, micro, count = CASES[name][1]
    case, m = record.case, record.metrics
    assert {k: case[k] for k in ("gpus", "pp", "tp", "dp", "micro_batch", "batch_size")} == \
        {"gpus": 4, "pp": pp, "tp": tp, "dp": dp, "micro_batch": micro, "batch_size": 8}
    # the id names the settings given (tp only when --tp was)
    assert (f"__p{pp}__" in case["id"]) == (pp > 1)
    assert (f"__t{tp}__" in case["id"]) == ("--tp" in CASES[name][0])
    assert {k: m.extra[k] for k in ("pp_size", "tp_size", "dp_size", "micro_batch",
                                    "n_microbatches")} == \
        {"pp_size": pp, "tp_size": tp, "dp_size": dp, "micro_batch": micro,
         "n_microbatches": count}
    # the precision policy and the optimizer, as every record states them (missing until
    # 2026-12-05)
    assert (m.extra["precision"], m.extra["optimizer"]) == \
        ("fp32", "torch.optim.adamw.AdamW (for-loop)")
    assert len(m.loss) == 3 and all(math.isfinite(x) and 5 < x < 9 for x in m.loss)
    assert m.samples_per_s > 0 and len(m.step_times) == 3 and m.tflops_per_gpu > 0
    assert len(m.params) == 4 and min(m.params) > 0 and record.env["world_size"] == 4
    notes = " ".join(m.extra["notes"])
    assert ("pipeline: 2 stages" in notes) if name.startswith("slapo") else \
        ("megatron-core 3D" in notes)


def test_slapo_3d_losses_follow_the_plain_model(records):
    plain = records["eager-llama"]
    assert plain.status == "ok", plain.reason
    for got, want in zip(records["slapo-llama-pp2-tp2"].metrics.loss, plain.metrics.loss,
                         strict=True):
        assert abs(got - want) <= LOSS_RTOL * abs(want), (got, want)


def test_megatron_replicas_train_like_one(records):
    """megatron-core TP 2 on 2 replicas (each half the batch, gradients averaged over the
    data-parallel group after the schedule) follows TP 2 alone on the whole batch."""
    alone = records["megatron-llama-tp2"]
    assert alone.status == "ok", alone.reason
    for got, want in zip(records["megatron-llama-dp2-tp2"].metrics.loss, alone.metrics.loss,
                         strict=True):
        assert abs(got - want) <= LOSS_RTOL * abs(want), (got, want)


def test_stages_hold_parts_of_the_model(records):
    """Each rank of a pipeline holds its stage: fewer parameters than the whole model."""
    whole = records["eager-llama"].metrics.params[0]
    parts = records["slapo-llama-pp2-tp2"].metrics.params
    assert max(parts) < whole / 2 and sum(parts) > whole * 0.9


@pytest.mark.parametrize("args, says", [
    (["--mode", "slapo-megatron", "--model", "bert-tiny", "--pp", "2"],
     "pipeline stages (pp=2) of a bert model: the harness cuts the layers of llama, gpt_neo"),
    (["--mode", "megatron", "--model", "bert-tiny", "--pp", "2"],
     "this harness runs megatron-core's GPT pipeline (GPT-Neo, LLaMA), not bert"),
    (["--mode", "slapo-megatron", "--model", "llama-tiny", "--pp", "4", "--tp", "1"],
     "pp=4 stages for 2 layers: a stage needs a layer"),
])
def test_what_the_pipeline_cannot_split_is_unsupported_before_launch(tmp_path, args, says):
    proc, record = run_case(tmp_path / "r.json", *args, "--gpus", "4", *RUN)
    assert record.status == "unsupported" and says in record.reason, record.reason
    assert "not launched" in (tmp_path / "r.log").read_text()
