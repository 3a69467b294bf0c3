"""ALBERT (transformers' AlbertForMaskedLM from a tiny config in code: 3 layers sharing one
layer's weights) scheduled with TP=2 on 2 gloo ranks equals the plain model: loss, logits
(vocabulary slices gathered) and every gradient (sharded ones gathered to full shape) over 3
SGD steps, fp32, dropout off, one sequence padded. Variants: the defaults on CPU (SDPA,
embedding and LM head sharded, vocabulary-parallel loss), transformers' kernels with 2 of the
3 calls of the shared layer checkpointed, gathered logits with every call checkpointed, 6
layers in 2 groups of 2 shared layers (3 of the 12 calls checkpointed), and the CUDA kernel
path compiled by Inductor on CPU (the shared layer one region). With dropout
on, both ranks compute one loss, and the attention-probability dropout draws from the
per-rank stream, leaving the default generator (which replicated dropout shares) alone.

Tolerance: relative error (slapo.verify) at most 1e-5, as tests/distributed/test_tp_equivalence;
1e-4 for the compiled variant (Inductor reassociates fp32 sums, as test_sched_compile).
"""

import copy

import pytest
import torch
from distributed import run_ranks
from sched_helpers import (
    assert_equal_training,
    dropout_loss_on_full_logits,
    probability_dropout_stream,
)

import slapo
from slapo.model_schedule import apply_schedule
from slapo.sharding import all_gather_forward
from slapo.verify import train_side_by_side

STEPS = 3
VOCAB = 91  # odd: the vocabulary sharded over 2 ranks is padded
LAYERS = 3


def albert_config(dropout: float = 0.0, groups: int = 1, inner: int = 1):
    from transformers import AlbertConfig

    return AlbertConfig(vocab_size=VOCAB, embedding_size=16, hidden_size=32,
                        num_hidden_layers=LAYERS * groups, num_hidden_groups=groups,
                        inner_group_num=inner, num_attention_heads=4, intermediate_size=64,
                        max_position_embeddings=32, hidden_dropout_prob=dropout,
                        attention_probs_dropout_prob=dropout, classifier_dropout_prob=dropout)


def _batch(step: int, batch: int = 2, seq: int = 12) -> dict:
    gen = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1, seq - 3:] = 0  # one sequence padded at the end
    labels = ids.masked_fill(torch.rand(batch, seq, generator=gen) > 0.5, -100)
    return {"input_ids": ids, "attention_mask": mask,
            "labels": labels.masked_fill(mask == 0, -100)}


def _gathered_loss(model, batch):
    out = model(**batch)
    logits = out.logits
    if logits.shape[-1] != VOCAB:  # this rank's vocabulary slice, padded
        logits = all_gather_forward(logits, -1)[..., :VOCAB]
    return out.loss, logits


def _albert(groups: int = 1, inner: int = 1, **sch_config):
    """Train the plain model and the scheduled one side by side; also count the checkpointed
    calls of the shared layers in one forward."""
    from transformers import AlbertForMaskedLM

    from slapo.model_schedule import common

    config = albert_config(groups=groups, inner=inner)
    torch.manual_seed(0)
    plain = AlbertForMaskedLM(config)
    sch = apply_schedule(copy.deepcopy(plain), copy.deepcopy(config), **sch_config)
    scheduled = slapo.build_module(sch)
    layer = scheduled.albert.encoder.albert_layer_groups[0].albert_layers[0]
    facts = {"query": tuple(layer.attention.query.weight.shape),
             "ffn": tuple(layer.ffn.weight.shape),
             "vocab": scheduled.albert.embeddings.word_embeddings.weight.shape[0],
             "tied": scheduled.predictions.decoder.weight
             is scheduled.albert.embeddings.word_embeddings.weight,
             "whole_layer_checkpointed": getattr(layer, "_slapo_checkpointed", False)}
    calls, real = [], common.checkpoint_call
    common.checkpoint_call = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        scheduled(**_batch(0)).loss.backward()
    finally:
        common.checkpoint_call = real
    scheduled.zero_grad()
    facts["checkpointed_calls"] = len(calls)
    batches = [_batch(step) for step in range(STEPS)]
    return facts, train_side_by_side(plain, scheduled, batches, _gathered_loss)


def _dropout_loss():
    from transformers import AlbertForMaskedLM

    return dropout_loss_on_full_logits(AlbertForMaskedLM, albert_config(dropout=0.2), _batch(0))


def _probability_dropout_stream():
    """Dropout on the attention probabilities only (fork_rng on each attention's core)."""
    from transformers import AlbertForMaskedLM

    config = albert_config()
    config.attention_probs_dropout_prob = 0.3
    return probability_dropout_stream(AlbertForMaskedLM, config, _batch(0))


def _pretraining_refused() -> str:
    """Sharding the embedding of an AlbertForPreTraining (whose loss adds sentence order)."""
    from transformers import AlbertForPreTraining

    try:
        apply_schedule(AlbertForPreTraining(albert_config()), albert_config())
    except NotImplementedError as err:
        return str(err)
    return "scheduled"


CASES = {"default": {}, "no_kernels": dict(kernel_opt=False, ckpt_ratio=0.5),
         "gathered_logits": dict(shard_embedding=False, ckpt_ratio=1.0),
         # 6 layers in 2 groups of 2 shared layers each: 12 calls a forward, 3 checkpointed
         "groups": dict(groups=2, inner=2, ckpt_ratio=0.25)}
CHECKPOINTED_CALLS = {"no_kernels": 2, "groups": 3}


def _all_cases():
    results = {case: _albert(**options) for case, options in CASES.items()}
    results["dropout_loss"] = _dropout_loss()
    results["probability_dropout"] = _probability_dropout_stream()
    results["pretraining"] = _pretraining_refused()
    return results


def _compiled_case():
    import torch._dynamo

    torch._dynamo.config.fail_on_recompile_limit_hit = True
    torch._dynamo.reset()
    return _albert(compile_layers=True, device="cpu", ckpt_ratio=0.5)


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all_cases)


@pytest.mark.parametrize("case", list(CASES))
def test_albert_tp2_equals_plain(results, case):
    for rank_results in results:
        facts, reports = rank_results[case]
        assert facts["query"] == (16, 32) and facts["ffn"] == (32, 32) and facts["tied"]
        # the vocabulary padded to 92 words, 46 a rank
        assert facts["vocab"] == (VOCAB if case == "gathered_logits" else 46)
        assert facts["checkpointed_calls"] == CHECKPOINTED_CALLS.get(case, 0)
        assert facts["whole_layer_checkpointed"] == (case == "gathered_logits")
        assert_equal_training(reports, case)
    print(f"albert {case} TP=2 worst gradient error per step:",
          [f"{r.max_grad_error[0]}={r.max_grad_error[1]:.1e}" for r in results[0][case][1]])


def test_albert_attention_probability_dropout_draws_per_rank(results):
    for rank_results in results:
        assert rank_results["probability_dropout"] == {"default_stream_untouched": True,
                                                       "dropout_acts": True}


def test_albert_with_dropout_one_loss_on_both_ranks(results):
    assert results[0]["dropout_loss"] == pytest.approx(results[1]["dropout_loss"], rel=1e-6)


def test_albert_sharded_embedding_is_refused_for_a_pretraining_model(results):
    for rank_results in results:
        assert rank_results["pretraining"].startswith(
            "shard_embedding: the ALBERT schedule shards the LM head of an AlbertForMaskedLM, "
            "not of AlbertForPreTraining")


@pytest.mark.slow
def test_albert_compiled_shared_layer_trains_as_the_plain_model_on_two_ranks():
    for rank, (facts, reports) in enumerate(run_ranks(_compiled_case)):
        assert facts["checkpointed_calls"] == 2, rank
        assert_equal_training(reports, f"albert compiled rank {rank}", tol=1e-4)
