"""Every family's TP=2 schedule equals the plain HF model (or the zoo's WideResNet).

Set-up: the tiny config of each family, fp32 (WideResNet float64: see sched_helpers), dropout
off (``no_dropout``), 2 CPU ranks over gloo, 3 SGD steps (``slapo.verify.train_side_by_side``)
on batches with right padding (and sequences longer than GPT-Neo's local window). Compared
after every step: the loss, the logits (vocabulary-sharded logits gathered) and every
parameter's gradient (sharded ones gathered to full shape), by relative error
``||a - b|| / max(||b||, 1e-3)`` <= 1e-5.

Two schedules per family, both against the plain eager model:
- ``full``: tensor parallelism with the embedding sharded (vocabulary-parallel cross entropy
  on sharded logits), kernel optimisation (SDPA attention, fused bias+GeLU), checkpoint
  ratio 0.5;
- ``tp-only``: tensor parallelism of attention and FFN only (embedding and LM head
  replicated), eager kernels, no checkpointing.
"""

import pytest
import torch
from distributed import run_ranks
from sched_helpers import (
    TINY,
    assert_equal_training,
    backward_node_names,
    loss_and_logits,
    padded_batches,
    side_by_side,
    worst,
)

from slapo.primitives.shard import shard_spec
from slapo.sharding import gather_sharded
from slapo.verify import relative_error

VARIANTS = {
    "full": dict(tensor_parallel=True, shard_embedding=True, kernel_opt=True, ckpt_ratio=0.5),
    "tp-only": dict(tensor_parallel=True, shard_embedding=False, kernel_opt=False, ckpt_ratio=0.0),
}


# per forward of the tiny models: attention and FFN of each layer (T5: 2 encoder blocks with
# 2 each, 2 decoder blocks with 3 each); WideResNet's convolutions do not overlap
OVERLAPS = {"bert": 4, "roberta": 4, "gpt_neo": 4, "opt": 4, "llama": 4, "t5": 10,
            "wideresnet": 0}
# with the vocabulary sharded, the LM head's input gradient too (its weight gradient, the
# largest matmul of the backward, while the all-reduce runs)
SHARDED_LM_HEAD_OVERLAPS = {"bert": 1, "roberta": 1, "gpt_neo": 1, "opt": 1, "llama": 1, "t5": 1,
                            "wideresnet": 0}


def _facts(family, plain, scheduled):
    """What the schedule did, checked beside the numbers (so equality is not vacuous)."""
    sharded = sorted(n for n, p in scheduled.named_parameters() if shard_spec(p) is not None)
    facts = {"sharded": len(sharded), "total": len(list(scheduled.parameters()))}
    if family == "wideresnet":
        # BatchNorm on sharded channels keeps the plain model's running statistics.
        for name, buf in scheduled.named_buffers():
            if name.endswith(("running_mean", "running_var")):
                plain_buf = dict(plain.named_buffers())[name]
                full = buf if buf.shape == plain_buf.shape else gather_sharded(buf, 0)
                facts.setdefault("bn_stats_error", 0.0)
                facts["bn_stats_error"] = max(facts["bn_stats_error"],
                                              relative_error(full, plain_buf))
    # the backward all-reduces that overlap column-parallel weight gradients (sync's overlap;
    # last: this forward changes BatchNorm statistics)
    batch = padded_batches(plain.config, steps=1, dtype=next(scheduled.parameters()).dtype)[0]
    loss, _ = loss_and_logits(scheduled, batch)
    facts["overlaps"] = backward_node_names(loss).count("_OverlapBackward")
    return facts


def _all_families():
    torch.manual_seed(0)
    results = {}
    for variant, options in VARIANTS.items():
        for family, name in TINY.items():
            reports, plain, scheduled = side_by_side(name, **options)
            results[variant, family] = (reports, _facts(family, plain, scheduled))
    return results


@pytest.fixture(scope="module")
def tp_results():
    return run_ranks(_all_families)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("family", list(TINY))
def test_tp2_schedule_equals_plain(tp_results, family, variant):
    for rank, results in enumerate(tp_results):
        reports, facts = results[variant, family]
        assert_equal_training(reports, f"{family} {variant} rank {rank}")
        assert facts["sharded"] > 0, f"{family} {variant}: nothing was sharded"
        expected = OVERLAPS[family] + (SHARDED_LM_HEAD_OVERLAPS[family]
                                       if VARIANTS[variant]["shard_embedding"] else 0)
        assert facts["overlaps"] == expected, f"{family} {variant}: {facts}"
        if "bn_stats_error" in facts and variant == "tp-only":
            assert facts["bn_stats_error"] <= 1e-5, facts
    print(f"{family} {variant}: {facts['sharded']}/{facts['total']} parameters sharded; "
          f"worst gradient error per step {worst(tp_results[0][variant, family][0])}")


def test_ranks_agree(tp_results):
    """Losses are replicated: both ranks report the same numbers."""
    for key, (reports, _) in tp_results[0].items():
        other = tp_results[1][key][0]
        assert [r.loss_scheduled for r in reports] == [r.loss_scheduled for r in other], key
