"""Dropout drawn for the device (``slapo.op.dropout``) and the CPU attention path that uses it.

On CPU the mask comes from 16-bit draws (four to each 64-bit draw), not ``bernoulli_``: the
same default generator, a different draw, the rate rounded to a multiple of 2**-16. Checked
here: the dropout computation itself (mask times ``1 / (1 - rounded p)``, forward and
backward), its rate at every lane of the 64-bit draws, its replay
under activation checkpointing and under seeds, SDPA's math kernel written out (equal to SDPA
within 1e-5 relative, forward and backward, with boolean, additive and grouped-query masks and
a query row that sees no key), and the schedules' replacement of every ``nn.Dropout``.
"""
import pytest
import torch
import torch.nn.functional as F
from sched_helpers import TINY
from torch import nn
from torch.utils.checkpoint import checkpoint

import slapo
from slapo.model_schedule import schedule_model
from slapo.op import Dropout, attention, dropout, dropout_kernel, math_attention
from slapo.op.dropout import keep_mask
from slapo.verify import relative_error
from slapo_ae.zoo import build_model

TOL = 1e-5


def test_cpu_dropout_scales_what_it_keeps_and_its_gradient_follows():
    torch.manual_seed(0)
    x = torch.randn(64, 256, requires_grad=True)
    y = dropout(x, 0.25)
    kept = y != 0
    assert torch.allclose(y[kept], x[kept] / 0.75)
    assert abs(kept.float().mean().item() - 0.75) < 0.01  # 16k draws: 4 standard deviations
    y.sum().backward()
    assert torch.allclose(x.grad, kept.float() / 0.75)


def test_dropout_off_and_edges():
    x = torch.randn(8, 8)
    assert dropout(x, 0.5, training=False) is x and dropout(x, 0.0) is x
    assert torch.equal(dropout(x, 1.0), torch.zeros_like(x))
    assert dropout_kernel("cpu") == "16-bit-mask" and dropout_kernel("cuda") == "F.dropout"


def test_dropout_in_a_compiled_region_is_one_graph_on_cpu_too():
    """Inside torch.compile the CPU mask's random_ would break the graph (fullgraph raises);
    the region draws F.dropout's mask instead, as on CUDA: kept elements scaled by 1 / 0.75,
    about a quarter dropped, the gradient through the same mask."""
    compiled = torch.compile(lambda t: dropout(t, 0.25), fullgraph=True)
    torch.manual_seed(0)
    x = torch.randn(64, 256, requires_grad=True)
    y = compiled(x)
    kept = y != 0
    assert torch.allclose(y[kept], x[kept] / 0.75)
    assert abs(kept.float().mean().item() - 0.75) < 0.01  # 16k draws: 4 standard deviations
    y.sum().backward()
    assert torch.allclose(x.grad, kept.float() / 0.75)


def test_cpu_rate_is_rounded_to_16_bits_and_what_is_kept_is_scaled_by_it():
    x = torch.randn(4096)
    y = dropout(x, 0.1)  # 0.1 rounds to 6554 / 65536
    kept = y != 0
    assert torch.allclose(y[kept], x[kept] * 65536 / (65536 - 6554), rtol=1e-6)
    for rate in (1e-6, 1 - 1e-6):  # rounds to 0 or 1: F.dropout at the exact rate
        torch.manual_seed(1)
        ours = dropout(x, rate)
        torch.manual_seed(1)
        assert torch.equal(ours, F.dropout(x, rate))


def test_every_lane_of_the_64_bit_draws_drops_at_the_rate():
    # random_() alone stops at 2**63 - 1, leaving one 16-bit lane in four never dropped
    torch.manual_seed(0)
    lanes = keep_mask((16384, 4), 32768).float().mean(0)  # rate 1/2; 4 sd = 0.016
    assert torch.all((lanes - 0.5).abs() < 0.016), lanes
    odd = keep_mask((3, 5, 7), 16384)  # not a multiple of four elements
    assert odd.shape == (3, 5, 7) and odd.dtype == torch.bool


def test_same_seed_same_mask_and_checkpoint_replays_it():
    x = torch.randn(32, 32, requires_grad=True)
    torch.manual_seed(3)
    plain = dropout(x, 0.5)
    plain.sum().backward()
    grad, x.grad = x.grad, None
    torch.manual_seed(3)
    replayed = checkpoint(lambda t: dropout(t, 0.5) * 1.0, x, use_reentrant=False)
    replayed.sum().backward()
    assert torch.equal(plain, replayed) and torch.equal(grad, x.grad)


def test_module_keeps_p_and_follows_train_and_eval():
    drop = Dropout(0.3)
    assert isinstance(drop, nn.Dropout) and drop.p == 0.3
    x = torch.ones(1000)
    assert (drop(x) == 0).any()
    assert torch.equal(drop.eval()(x), x)


def _qkv(heads=4, kv_heads=4, q_len=12, k_len=12, grad=True):
    torch.manual_seed(1)
    shape = lambda h, s: (2, h, s, 16)  # noqa: E731
    return [torch.randn(*shape(h, s), requires_grad=grad)
            for h, s in ((heads, q_len), (kv_heads, k_len), (kv_heads, k_len))]


@pytest.mark.parametrize("case", ["none", "bool", "additive", "gqa", "row-without-keys"])
def test_math_attention_is_sdpa(case):
    q, k, v = _qkv(kv_heads=2 if case == "gqa" else 4)
    mask = None
    if case in ("bool", "row-without-keys"):
        mask = torch.rand(2, 1, 12, 12) > 0.3
        mask[..., 0] = True
        if case == "row-without-keys":
            mask[0, 0, 5] = False
    elif case == "additive":
        mask = torch.randn(2, 4, 12, 12)
    ours = math_attention(q, k, v, mask, scale=0.3)
    ref_inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_inputs, attn_mask=mask, scale=0.3,
                                         enable_gqa=case == "gqa")
    assert relative_error(ours, ref) < TOL
    ours.square().sum().backward()
    ref.square().sum().backward()
    for a, b in zip((q, k, v), ref_inputs):
        assert relative_error(a.grad, b.grad) < TOL
    if case == "row-without-keys":
        assert torch.equal(ours[0, :, 5], torch.zeros_like(ours[0, :, 5]))


def test_cpu_attention_with_dropout_drops_probabilities_with_the_16_bit_mask():
    q, k, v = _qkv(grad=False)
    torch.manual_seed(7)
    ours = attention(q, k, v, causal=True, dropout_p=0.2)
    torch.manual_seed(7)  # the same draw, written out: softmax(causal scores), 16-bit mask
    scores = (q @ k.transpose(-1, -2)) / 4.0
    scores = scores.masked_fill(torch.ones(12, 12, dtype=torch.bool).triu(1), float("-inf"))
    probs = scores.softmax(-1)
    levels = round(0.2 * 65536)
    keep = keep_mask(probs.shape, levels).float() * 65536 / (65536 - levels)
    assert relative_error(ours, (probs * keep) @ v) < TOL


@pytest.mark.parametrize("family", ["bert", "gpt_neo", "t5", "opt"])
def test_kernel_schedules_replace_every_dropout_and_keep_its_rate(family):
    model = build_model(TINY[family], seed=0)
    rates = sorted(m.p for m in model.modules() if type(m) is nn.Dropout)
    sch = slapo.create_schedule(model)
    schedule_model(sch, tensor_parallel=False, kernel_opt=True)
    built = slapo.build_module(sch)
    assert not [m for m in built.modules() if type(m) is nn.Dropout]
    assert sorted(m.p for m in built.modules() if isinstance(m, Dropout)) == rates
