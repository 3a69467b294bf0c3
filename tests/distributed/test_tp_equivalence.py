"""A Megatron-style TP=2 schedule equals the plain model: loss, output and every gradient
(gathered to full shape) over 3 SGD steps, fp32, on 2 CPU ranks over gloo.

Tolerance: relative error ``||a - b|| / max(||b||, 1e-3)`` (slapo.verify) at most 1e-5 for the
loss, the output and each parameter's gradient.
"""

import copy

import pytest
import torch
from distributed import run_ranks
from sched_helpers import assert_equal_training, loss_and_logits
from tiny_modules import (
    AttentionBlock,
    MLPBlock,
    bert_batch,
    schedule_attention,
    schedule_mlp,
    small_bert_config,
)

import slapo
from slapo.model_schedule import schedule_model
from slapo.verify import train_side_by_side

TOL = 1e-5
STEPS = 3


def _tensor_batches(shape, steps=STEPS):
    return [{"x": torch.randn(*shape, generator=torch.Generator().manual_seed(s))}
            for s in range(steps)]


def _sum_of_squares(model, batch):
    out = model(batch["x"])
    return (out ** 2).mean(), out


def _side_by_side(make_model, schedule, batches, forward):
    torch.manual_seed(0)
    plain = make_model()
    sch = slapo.create_schedule(copy.deepcopy(plain))
    schedule(sch)
    scheduled = slapo.build_module(sch)
    return train_side_by_side(plain, scheduled, batches, forward)


def _mlp_and_attention():
    return {
        "mlp": _side_by_side(MLPBlock, schedule_mlp, _tensor_batches((4, 8, 32)),
                             _sum_of_squares),
        "mlp_missing_bwd_sync": _side_by_side(
            MLPBlock, lambda s: schedule_mlp(s, input_grad_sync=False),
            _tensor_batches((4, 8, 32)), _sum_of_squares),
        "attention": _side_by_side(AttentionBlock, schedule_attention,
                                   _tensor_batches((4, 8, 32)), _sum_of_squares),
    }


def _bert():
    config = small_bert_config()
    from transformers import BertForMaskedLM

    torch.manual_seed(0)
    plain = BertForMaskedLM(config)
    sch = slapo.create_schedule(copy.deepcopy(plain))
    schedule_model(sch, kernel_opt=False)  # TP with the vocabulary-parallel loss
    scheduled = slapo.build_module(sch)
    emb = scheduled.bert.embeddings.word_embeddings.weight
    facts = {
        "tied": scheduled.cls.predictions.decoder.weight is emb,
        "local_vocab": emb.shape[0],
        "local_qkv": scheduled.bert.encoder.layer[0].attention.self.query.weight.shape[0],
    }
    batches = [bert_batch(config, step) for step in range(STEPS)]
    return facts, train_side_by_side(plain, scheduled, batches, loss_and_logits)


@pytest.fixture(scope="module")
def blocks():
    return run_ranks(_mlp_and_attention)


@pytest.mark.parametrize("case", ["mlp", "attention"])
def test_block_equals_plain(blocks, case):
    for rank_reports in blocks:
        assert_equal_training(rank_reports[case], case)


def test_missing_bwd_sync_is_caught_by_gradients_not_loss(blocks):
    first_step = blocks[0]["mlp_missing_bwd_sync"][0]
    # The forward is untouched, so the first loss still matches...
    assert first_step.loss_error <= TOL
    # ...but the norm upstream of fc1 receives only this rank's partial gradient.
    assert first_step.grad_errors["norm.weight"] > 1e-2
    assert first_step.grad_errors["fc1.weight"] <= TOL


def test_small_bert_tp2_equals_plain():
    results = run_ranks(_bert)
    for facts, reports in results:
        assert facts == {"tied": True, "local_vocab": 256, "local_qkv": 64}
        assert_equal_training(reports, "bert")
        print("bert TP=2 worst gradient error per step:",
              [f"{r.max_grad_error[0]}={r.max_grad_error[1]:.1e}" for r in reports])
