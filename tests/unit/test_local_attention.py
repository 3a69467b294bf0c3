"""GPT-Neo's local attention by chunks of its window (``slapo.op.sdpa.local_attention``, the
CUDA path), run here on CPU against the dense call under the window's mask: forward and
backward, grouped-query attention, compiled; when ``attention`` takes it; and GPT-Neo's
compiled schedule on that path training as the plain model. Tolerance: 1e-5 (fp32, relative
to the largest value)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import slapo
from slapo.op import attention, merge_masks, sdpa
from slapo.op.sdpa import local_attention


def _qkv(length, kv_heads=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, heads, length, 8, generator=gen, requires_grad=True)
            for heads in (4, kv_heads, kv_heads)]


def _dense(q, k, v, window, scale):
    mask = merge_masks(q.shape[-2], k.shape[-2], q.dtype, q.device, causal=True, window=window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                          enable_gqa=k.shape[1] != q.shape[1])


def _assert_same(fn, reference, q, k, v):
    out, want = fn(q, k, v), reference(q, k, v)
    grad = torch.randn_like(want)
    got_grads = torch.autograd.grad(out, (q, k, v), grad)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    for got, expected in zip((out, *got_grads), (want, *want_grads)):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5 * float(expected.abs().max()))


@pytest.mark.parametrize("length, window, kv_heads, scale", [
    (64, 16, 4, 1.0),  # GPT-Neo: no 1/sqrt(d)
    (48, 16, 2, None),  # three chunks, grouped-query attention
    (32, 16, 4, 1.0),  # two chunks
])
def test_by_chunks_equals_the_dense_masked_call(length, window, kv_heads, scale):
    q, k, v = _qkv(length, kv_heads)
    _assert_same(lambda q, k, v: local_attention(q, k, v, window, scale),
                 lambda q, k, v: _dense(q, k, v, window, scale), q, k, v)


def test_compiled_in_one_graph():
    q, k, v = _qkv(64)

    def run(q, k, v):
        return local_attention(q, k, v, 16, 1.0)

    explained = torch._dynamo.explain(run)(q, k, v)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    try:
        _assert_same(torch.compile(run), lambda q, k, v: _dense(q, k, v, 16, 1.0), q, k, v)
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("length, chunked", [(64, True), (40, False), (16, False)])
def test_attention_takes_it_for_whole_windows_without_padding_on_cuda(
        monkeypatch, length, chunked):
    calls = []
    monkeypatch.setattr(sdpa, "local_attention",
                        lambda *args: calls.append(args) or local_attention(*args))
    q, k, v = _qkv(length)
    attention(q, k, v, causal=True, window=16, scale=1.0)
    assert not calls  # on CPU: the dense masked call
    monkeypatch.setattr(sdpa, "BANDED_ON", ("cpu", "cuda"))
    attention(q, k, v, causal=True, window=16, scale=1.0)
    padding = torch.ones(2, 1, 1, length, dtype=torch.bool)
    attention(q, k, v, padding, causal=True, window=16, scale=1.0)  # a mask: dense
    assert len(calls) == int(chunked)


@pytest.mark.slow
def test_gpt_neo_compiled_schedule_on_chunks_trains_as_the_plain_model(monkeypatch):
    """GPT-Neo's local layer (window 16) by chunks inside its compiled layer: the plain
    model's loss and gradients (relative error of each gradient at most 1e-4)."""
    from slapo.model_schedule import schedule_model
    from slapo_ae.zoo import build_model, no_dropout, synthetic_batch

    monkeypatch.setattr(sdpa, "BANDED_ON", ("cpu",))
    chunked = []
    real = sdpa.local_attention
    monkeypatch.setattr(sdpa, "local_attention", lambda *a: chunked.append(1) or real(*a))
    torch.manual_seed(0)
    plain = build_model("gpt-neo-tiny", **no_dropout("gpt-neo-tiny"))
    scheduled = copy.deepcopy(plain)
    schedule_model(slapo.create_schedule(scheduled), tensor_parallel=False, kernel_opt=True,
                   device="cpu", compile_layers=True)
    batch = synthetic_batch(plain.config, 2, 64, seed=0)
    try:
        losses = []
        for model in (plain, scheduled):
            loss = model(**batch).loss
            loss.backward()
            losses.append(loss.detach())
    finally:
        torch._dynamo.reset()
    assert chunked  # traced into the local layer's region
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=0)
    grads = dict(scheduled.named_parameters())
    for name, param in plain.named_parameters():
        error = (grads[name].grad - param.grad).norm() / param.grad.norm().clamp_min(1e-3)
        assert error < 1e-4, (name, float(error))
