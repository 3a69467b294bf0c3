"""On 2 CPU ranks over gloo:

1. fork_rng in the TP schedules: with dropout on, dropout inside the sharded regions
   (attention probabilities; T5's FFN activation) draws different masks on each rank, while
   dropout on replicated activations draws the same masks everywhere, so the replicated
   hidden states and the loss stay identical across ranks. To make the first point testable,
   the plain model's projections are equalised so that rank 0's heads equal rank 1's: the
   sharded activations then agree across ranks exactly when no dropout acts on them.
2. The vocabulary-parallel cross entropy equals ``F.cross_entropy`` on the gathered logits
   (loss and gradient, ``ignore_index=-100``, every reduction), and a scheduled LM keeps its
   logits sharded while ``out.loss`` (also ``out[0]``, ``out["loss"]``) is the full loss.
"""

import copy
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_ranks

import slapo
from slapo.hooks import map_first_tensor
from slapo.model_schedule import schedule_model
from slapo.op import vocab_parallel_cross_entropy
from slapo.sharding import gather_sharded
from slapo.verify import relative_error
from slapo_ae.zoo import build_model, synthetic_batch

# family: (dropout overrides, [(parameter regex, axis) to equalise across the two shards],
#          modules whose INPUT is sharded, modules whose OUTPUT is replicated)
PROBES = {
    "bert-tiny": (
        dict(attention_probs_dropout_prob=0.3, hidden_dropout_prob=0.1),
        [(r"attention\.self\.(query|key|value)\.(weight|bias)$", 0)],
        ["bert.encoder.layer.0.attention.output.dense"],
        ["bert.encoder.layer.0", "bert.encoder.layer.1"]),
    "gpt-neo-tiny": (
        dict(attention_dropout=0.3, resid_dropout=0.1, embed_dropout=0.1),
        [(r"attn\.attention\.[qkv]_proj\.weight$", 0)],
        ["transformer.h.0.attn.attention.out_proj", "transformer.h.1.attn.attention.out_proj"],
        ["transformer.h.0", "transformer.h.1"]),
    "t5-tiny": (
        dict(dropout_rate=0.2),
        [(r"(SelfAttention|EncDecAttention)\.[qkv]\.weight$", 0),
         (r"relative_attention_bias\.weight$", 1), (r"DenseReluDense\.wi\.weight$", 0)],
        ["encoder.block.0.layer.0.SelfAttention.o", "encoder.block.0.layer.1.DenseReluDense.wo",
         "decoder.block.1.layer.1.EncDecAttention.o"],
        ["encoder.block.0", "decoder.block.1"]),
}


def _equalise(model, rules):
    with torch.no_grad():
        for name, param in model.named_parameters():
            for pattern, axis in rules:
                if re.search(pattern, name):
                    first, second = param.chunk(2, dim=axis)
                    second.copy_(first)


def _probe_run(name, dropout_on, kernel_opt):
    overrides, rules, sharded, replicated = PROBES[name]
    model = build_model(name, **(overrides if dropout_on else {k: 0.0 for k in overrides}))
    _equalise(model, rules)
    sch = slapo.create_schedule(model)
    schedule_model(sch, kernel_opt=kernel_opt, ckpt_ratio=0.0)
    seen = {}
    for path in sharded:
        model.get_submodule(path).register_forward_pre_hook(
            lambda m, args, path=path: seen.__setitem__(path, args[0].detach().clone()))
    for path in replicated:
        model.get_submodule(path).register_forward_hook(
            lambda m, args, out, path=path: map_first_tensor(
                out, lambda t: seen.__setitem__(path, t.detach().clone()) or t))
    torch.manual_seed(0)  # the same seed on every rank, as a training script does
    out = model(**synthetic_batch(name, 2, 24, 12))
    return {"loss": out.loss.item(), **seen}


def _rng_and_ce():
    results = {}
    for name in PROBES:
        for kernel_opt in (False, True):
            for dropout_on in (False, True):
                results[name, kernel_opt, dropout_on] = _probe_run(name, dropout_on, kernel_opt)
    results["ce"] = _ce_errors()
    results["lm_output"] = _lm_output()
    return results


def _ce_errors():
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 64, generator=gen) * 3
    target = torch.randint(0, 64, (3, 7), generator=gen)
    target[0, :3] = -100
    upstream = torch.rand(3, 7, generator=gen)
    errors = {}
    for reduction in ("mean", "sum", "none"):
        local = logits.chunk(world, -1)[rank].clone().requires_grad_()
        full = logits.clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, target, reduction=reduction)
        ref = F.cross_entropy(full.flatten(0, 1), target.flatten(), ignore_index=-100,
                              reduction=reduction)
        ref = ref.view(3, 7) if reduction == "none" else ref
        weight = upstream if reduction == "none" else 1.0
        (loss * weight).sum().backward()
        (ref * weight).sum().backward()
        errors[reduction] = (relative_error(loss, ref),
                             relative_error(gather_sharded(local.grad, -1), full.grad),
                             full.grad[0, :3].abs().max().item())
    return errors


def _lm_output():
    model = build_model("gpt-neo-tiny")
    plain = copy.deepcopy(model)
    schedule_model(slapo.create_schedule(model))
    batch = synthetic_batch("gpt-neo-tiny", 2, 24)
    batch["labels"][:, :5] = -100
    out, ref = model(**batch), plain(**batch)
    return {"width": out.logits.shape[-1], "first_is_loss": out[0] is out.loss,
            "key": out["loss"] is out.loss,
            "loss_error": relative_error(out.loss, ref.loss),
            "logits_error": relative_error(gather_sharded(out.logits, -1), ref.logits)}


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_rng_and_ce)


def _same(a, b):
    return torch.equal(a, b)


@pytest.mark.parametrize("kernel_opt", [False, True])
@pytest.mark.parametrize("name", list(PROBES))
def test_fork_rng_in_sharded_regions_only(ranks, name, kernel_opt):
    _, _, sharded, replicated = PROBES[name]
    r0, r1 = ranks
    off0, off1 = r0[name, kernel_opt, False], r1[name, kernel_opt, False]
    on0, on1 = r0[name, kernel_opt, True], r1[name, kernel_opt, True]
    for path in sharded:
        # Equalised shards: without dropout the sharded activations agree across ranks...
        assert _same(off0[path], off1[path]), path
        # ...with dropout they differ: each rank draws its own masks there.
        assert not _same(on0[path], on1[path]), path
    for path in replicated:
        assert _same(on0[path], on1[path]), path  # replicated activations stay identical
    assert on0["loss"] == on1["loss"]
    assert on0["loss"] != off0["loss"]  # dropout did act


def test_vocab_parallel_cross_entropy_equals_gathered(ranks):
    for rank_result in ranks:
        for reduction, (loss_err, grad_err, ignored_grad) in rank_result["ce"].items():
            assert loss_err <= 1e-6, reduction
            assert grad_err <= 1e-6, reduction
            assert ignored_grad == 0.0, reduction


def test_scheduled_lm_keeps_logits_sharded(ranks):
    for rank_result in ranks:
        facts = rank_result["lm_output"]
        assert facts["width"] == 512  # 1024 / 2 ranks
        assert facts["first_is_loss"] and facts["key"]
        assert facts["loss_error"] <= 1e-5 and facts["logits_error"] <= 1e-5


def test_vocab_parallel_cross_entropy_single_process():
    logits = torch.randn(5, 11, requires_grad=True)
    target = torch.tensor([1, -100, 10, 0, 3])
    loss = vocab_parallel_cross_entropy(logits, target)
    ref = F.cross_entropy(logits, target)
    assert relative_error(loss, ref) <= 1e-6
    grad, = torch.autograd.grad(loss, logits)
    ref_grad, = torch.autograd.grad(ref, logits)
    assert relative_error(grad, ref_grad) <= 1e-6
    with pytest.raises(ValueError, match="disagree"):
        vocab_parallel_cross_entropy(logits, target[:3])
