"""The HF baselines of the one-GPU comparison, ``hf-sdpa`` and ``hf-compile``: each trains the
same model as ``eager`` from the same weights and batches, so its losses follow eager's; only
the attention kernel (SDPA) and the compiler (inductor) differ.

bert-tiny, 1 CPU rank, fp32, dropout off, 3 steps. Tolerances: SDPA against eager attention
1e-5 relative per step's loss (measured: about 1e-7); the compiled model 1e-4 (inductor
reorders reductions; measured: about 1e-7).
"""
from __future__ import annotations

import pytest
from harness_util import run_case

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

ONE_RANK = ["--model", "bert-tiny", "--gpus", "1", "--seq-len", "16", "--batch-size", "4",
            "--steps", "3", "--warmup", "1", "--no-dropout"]
MODES = ("eager", "hf-sdpa", "hf-compile")


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {mode: run_case(root / f"{mode}.json", "--mode", mode, *ONE_RANK)[1] for mode in MODES}


@pytest.mark.parametrize("mode,rel", [("hf-sdpa", 1e-5), ("hf-compile", 1e-4)])
def test_baseline_follows_eager(records, mode, rel):
    record, eager = records[mode], records["eager"]
    assert record.status == "ok", record.reason
    assert record.metrics.samples_per_s > 0
    worst = max(abs(a - b) / abs(b) for a, b in zip(record.metrics.loss, eager.metrics.loss))
    print(f"\n{mode}: losses {record.metrics.loss}, eager {eager.metrics.loss}, "
          f"worst relative difference {worst:.1e}")
    assert record.metrics.loss == pytest.approx(eager.metrics.loss, rel=rel)
    assert record.metrics.loss[0] != record.metrics.loss[-1]  # the optimizer moved


def test_notes_name_the_attention_and_the_compiler(records):
    assert records["eager"].metrics.extra["notes"] == []
    assert "HF attention implementation: sdpa" in records["hf-sdpa"].metrics.extra["notes"]
    compiled = records["hf-compile"].metrics.extra["notes"]
    assert any(n.startswith("torch.compile") for n in compiled)


def test_hf_liger_is_unsupported_on_cpu(tmp_path):
    """liger-kernel's kernels are Triton's, for GPUs: a CPU case says so, before launching."""
    proc, record = run_case(tmp_path / "r.json", "--mode", "hf-liger", "--model", "llama-tiny",
                            "--gpus", "1", "--seq-len", "16", "--batch-size", "2",
                            "--steps", "2", "--warmup", "1")
    assert record.status == "unsupported"
    assert record.reason == ("liger-kernel's kernels are Triton kernels for GPUs; they do not "
                             "run on CPU")


@pytest.mark.parametrize("model,why", [("gpt-neo-tiny", "no SDPA attention for GPT-Neo"),
                                       ("wideresnet-tiny", "WideResNet has no attention")])
def test_hf_sdpa_without_sdpa_is_unsupported(tmp_path, model, why):
    proc, record = run_case(tmp_path / "r.json", "--mode", "hf-sdpa", "--model", model,
                            "--gpus", "1", "--seq-len", "16", "--batch-size", "2",
                            "--steps", "2", "--warmup", "1")
    assert record.status == "unsupported" and why in record.reason
    assert record.metrics.samples_per_s is None
