"""Kernel optimisation: SDPA attention and fused bias+GeLU equal the eager computation.

Tolerance: relative error ``||a - b|| / max(||b||, 1e-3)`` (slapo.verify) at most 1e-5 in
fp32, for attention outputs and their input gradients, and for whole models (loss, logits
and every gradient over 3 SGD steps, on batches with right padding). The fused GeLU in eager
mode is the same expression as the reference, so it is held to 1e-6.
"""

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from sched_helpers import TINY, assert_equal_training, side_by_side, worst
from torch import nn

import slapo.op.sdpa as sdpa_module
from slapo.model_schedule import gpt_neo as gpt_neo_schedule
from slapo.op import (
    CoreAttention,
    LinearGeLU,
    attention,
    bias_gelu,
    compiled_kernel_state,
    gelu_approximation,
)
from slapo.primitives.fuse import FusedModule
from slapo.verify import relative_error

TOL = 1e-5


# --- the attention op against a reference written out in eager PyTorch ------------------
def _reference(q, k, v, mask=None, bias=None, causal=False, window=None, scale=None):
    """softmax(q k^T * scale + bias + mask) v with HF's conventions (masked = dtype min)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ k.transpose(-1, -2) * scale
    if bias is not None:
        scores = scores + bias
    lowest = torch.finfo(scores.dtype).min
    if mask is not None:
        scores = scores.masked_fill(~mask, lowest) if mask.dtype == torch.bool else scores + mask
    q_len, k_len = q.shape[-2], k.shape[-2]
    i = torch.arange(q_len)[:, None] + (k_len - q_len)
    j = torch.arange(k_len)[None, :]
    if causal or window is not None:
        scores = scores.masked_fill(j > i, lowest)
    if window is not None:
        scores = scores.masked_fill(i - j >= window, lowest)
    return scores.softmax(-1) @ v


def _inputs(b=2, h=4, hkv=4, q_len=12, k_len=12, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=gen, requires_grad=True)  # noqa: E731
    return make(b, h, q_len, d), make(b, hkv, k_len, d), make(b, hkv, k_len, d)


def _padding(b=2, k_len=12, pad=4):
    keep = torch.ones(b, 1, 1, k_len, dtype=torch.bool)
    keep[-1, ..., -pad:] = False
    return keep


def _hf_additive(keep):
    return torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)


CASES = {
    "no mask": dict(),
    "padding (bool)": dict(mask=_padding()),
    "padding (additive, HF eager)": dict(mask=_hf_additive(_padding())),
    "causal": dict(causal=True),
    "causal + padding": dict(causal=True, mask=_padding()),
    "causal, fewer queries than keys": dict(causal=True, q_len=5),
    "GPT-Neo local window, no scaling": dict(causal=True, window=4, scale=1.0),
    # (2 padded keys: with 4, the last rows' windows would hold padding only, see below)
    "GPT-Neo local window + padding": dict(causal=True, window=4, scale=1.0,
                                           mask=_padding(pad=2)),
    "T5 relative bias, scale 1": dict(bias=torch.randn(1, 4, 12, 12), scale=1.0),
    "T5 relative bias + padding": dict(bias=torch.randn(1, 4, 12, 12), scale=1.0,
                                       mask=_padding()),
    "T5 decoder: bias + causal": dict(bias=torch.randn(1, 4, 12, 12), scale=1.0, causal=True),
    "grouped-query attention + causal": dict(hkv=2, causal=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_attention_op_equals_eager(case):
    kwargs = dict(CASES[case])
    shape = {key: kwargs.pop(key) for key in ("hkv", "q_len") if key in kwargs}
    q, k, v = _inputs(**shape)
    out = attention(q, k, v, kwargs.pop("mask", None), **kwargs)
    ref = _reference(q, k, v, **{**kwargs, "mask": CASES[case].get("mask")})
    assert relative_error(out, ref) <= TOL
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for grad, ref_grad in zip(grads, ref_grads):
        assert relative_error(grad, ref_grad) <= TOL, case


def test_fully_masked_rows_give_zeros():
    """A query with no key to attend to (a window over padding only) gets zeros (SDPA's
    convention), where HF's eager code averages masked scores; such rows are padding."""
    q, k, v = _inputs()
    out = attention(q, k, v, _padding(pad=4), causal=True, window=4, scale=1.0)
    # The last query's window (keys 8..11) is all padding; the query before still sees key 7.
    assert torch.equal(out[-1, :, -1], torch.zeros_like(out[-1, :, -1]))
    assert out[-1, :, -2].abs().sum() > 0
    assert torch.isfinite(out).all()


def test_attention_dropout_follows_the_default_generator():
    core = CoreAttention(causal=True, dropout=0.5).train()
    q, k, v = _inputs()
    torch.manual_seed(1)
    first = core(q, k, v)
    torch.manual_seed(1)
    again = core(q, k, v)
    torch.manual_seed(2)
    other = core(q, k, v)
    assert torch.equal(first, again)           # reproducible from the seed (checkpoint, fork_rng)
    assert not torch.equal(first, other)
    assert relative_error(core.eval()(q, k, v), _reference(q, k, v, causal=True)) <= TOL


# --- whole models: kernel_opt at world size 1 against the plain eager model --------------
@pytest.fixture
def sdpa_calls(monkeypatch):
    calls = []
    inner = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs.get("attn_mask") is not None)
        return inner(*args, **kwargs)

    monkeypatch.setattr(sdpa_module.F, "scaled_dot_product_attention", spy)
    return calls


ATTENTION_CALLS = {"bert": 2, "roberta": 2, "gpt_neo": 2, "opt": 2, "llama": 2,
                   "t5": 6, "wideresnet": 0}  # per forward: T5 = 2 encoder + 2x2 decoder


@pytest.mark.parametrize("family", list(TINY))
def test_kernel_opt_model_equals_plain(family, sdpa_calls):
    reports, _, scheduled = side_by_side(TINY[family], tensor_parallel=False, kernel_opt=True)
    assert_equal_training(reports, f"{family} kernel_opt")
    # Two forwards per step (plain, scheduled); only the scheduled one goes through SDPA.
    assert len(sdpa_calls) == 3 * ATTENTION_CALLS[family]
    # bias+GeLU found in the traced FFN and fused (the static-graph path); GPT-Neo's
    # written-out tanh GeLU replaced by one GeLU op
    fused = [m for m in scheduled.modules() if isinstance(m, FusedModule)]
    assert len(fused) == {"bert": 2, "roberta": 2}.get(family, 0)
    assert all("gelu" in m.graph_module.code for m in fused)
    replaced = [n for m in scheduled.modules() if isinstance(m, torch.fx.GraphModule)
                for n in m.graph.nodes if n.target is gpt_neo_schedule.gelu_kernel]
    assert len(replaced) == (2 if family == "gpt_neo" else 0)
    print(f"{family} kernel_opt: worst gradient error per step {worst(reports)}")


# --- fused bias + GeLU --------------------------------------------------------------------
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu_eager_equals_reference(approximate):
    x = torch.randn(3, 5, 16, requires_grad=True)
    b = torch.randn(16, requires_grad=True)
    out = bias_gelu(x, b, approximate, compile=False)
    ref = F.gelu(x + b, approximate=approximate)
    assert relative_error(out, ref) <= 1e-6
    for g, r in zip(torch.autograd.grad(out.sum(), (x, b)), torch.autograd.grad(ref.sum(), (x, b))):
        assert relative_error(g, r) <= 1e-6


def test_linear_gelu_matches_hf_activations():
    from transformers.activations import GELUActivation, NewGELUActivation

    for act, flavour in ((GELUActivation(), "none"), (NewGELUActivation(), "tanh")):
        assert gelu_approximation(act) == flavour
        linear = nn.Linear(16, 32)
        fused = LinearGeLU.from_linear(linear, flavour)
        assert fused.weight is linear.weight and fused.bias is linear.bias
        x = torch.randn(4, 16)
        # gelu_new's Python formula and F.gelu(approximate="tanh") agree to float rounding.
        assert relative_error(fused(x), act(linear(x))) <= 1e-6
    assert gelu_approximation(nn.ReLU()) is None


@pytest.mark.slow
def test_bias_gelu_compiled_path(caplog):
    """The torch.compile kernel (forced on CPU) equals the eager expression, or, where
    compilation fails on the platform, falls back to it and says so in the log."""
    x = torch.randn(4, 8, 64, requires_grad=True)
    b = torch.randn(64, requires_grad=True)
    with caplog.at_level(logging.WARNING, logger="slapo.op.gelu"):
        out = bias_gelu(x, b, "tanh", compile=True)
    ref = F.gelu(x + b, approximate="tanh")
    state = compiled_kernel_state()
    print(f"bias_gelu kernel: {state}")
    if state.startswith("failed"):
        assert "slapo.op.gelu: torch.compile failed" in caplog.text
    else:
        assert state == "compiled"
    assert relative_error(out, ref) <= 1e-6
    for g, r in zip(torch.autograd.grad(out.sum(), (x, b)), torch.autograd.grad(ref.sum(), (x, b))):
        assert relative_error(g, r) <= 1e-6
