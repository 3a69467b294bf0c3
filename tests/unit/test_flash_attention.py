"""slapo.op.FlashAttention (upstream Slapo's module, on SDPA) against attention written out by
hand: fused and separate q/k/v, with no mask, an additive HF mask or a boolean mask, causal
(``output_proj=True``, upstream's decoder) or not; the key/value cache; the refusals.

Tolerance: 1e-5 absolute in fp32.
"""

import math

import pytest
import torch

from slapo.op import FlashAttention

HIDDEN, HEADS, BATCH, SEQ = 32, 4, 2, 7
HEAD = HIDDEN // HEADS


def _by_hand(attn: FlashAttention, x, mask=None):
    """q, k, v projections, softmax(q k^T / sqrt(d) + mask) v per head, output projection."""
    if attn.fused_qkv:
        # output features head by head, each head's q, k, v side by side
        fused = (x @ attn.qkv.weight.T + attn.qkv.bias).view(BATCH, SEQ, HEADS, 3, HEAD)
        q, k, v = fused.unbind(3)
    else:
        q, k, v = ((x @ lin.weight.T + lin.bias).view(BATCH, SEQ, HEADS, HEAD)
                   for lin in (attn.query, attn.key, attn.value))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(HEAD)
    if attn.output_proj:  # causal
        scores = scores.masked_fill(torch.ones(SEQ, SEQ).triu(1).bool(), float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool \
            else scores + mask
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(BATCH, SEQ, HIDDEN)
    if attn.output_proj:
        out = out @ attn.out_proj.weight.T + attn.out_proj.bias
    return out


def _padding_masks():
    keep = torch.ones(BATCH, SEQ, dtype=torch.bool)
    keep[1, 5:] = False  # the second sequence is padded at the end
    additive = (~keep).float()[:, None, None, :] * torch.finfo(torch.float32).min  # HF style
    return {"none": None, "additive": additive, "bool": keep[:, None, None, :]}


@pytest.mark.parametrize("fused_qkv", [True, False])
@pytest.mark.parametrize("output_proj", [True, False], ids=["causal", "not_causal"])
@pytest.mark.parametrize("mask_kind", ["none", "additive", "bool"])
def test_flash_attention_equals_attention_by_hand(fused_qkv, output_proj, mask_kind):
    torch.manual_seed(0)
    attn = FlashAttention(HIDDEN, HEADS, attn_pdrop=0.3, resid_pdrop=0.3, fused_qkv=fused_qkv,
                          output_proj=output_proj, attn_op_name="cuda").eval()
    x = torch.randn(BATCH, SEQ, HIDDEN)
    mask = _padding_masks()[mask_kind]
    out, present = attn(x, mask)
    assert present is None
    torch.testing.assert_close(out, _by_hand(attn, x, mask), atol=1e-5, rtol=0)


def test_parameter_names_are_upstreams():
    fused = FlashAttention(HIDDEN, HEADS, fused_qkv=True)
    assert {n for n, _ in fused.named_parameters()} == {
        "qkv.weight", "qkv.bias", "out_proj.weight", "out_proj.bias"}
    plain = FlashAttention(HIDDEN, HEADS, output_proj=False, bias=False)
    assert {n for n, _ in plain.named_parameters()} == {"query.weight", "key.weight",
                                                        "value.weight"}
    assert plain.attn_op.apply_causal_mask is False and fused.attn_op.apply_causal_mask is True


def test_cache_continues_the_sequence():
    """The last token attending over the cached keys and values of the others gives the last
    row of the full causal attention."""
    torch.manual_seed(1)
    attn = FlashAttention(HIDDEN, HEADS, fused_qkv=True).eval()
    x = torch.randn(BATCH, SEQ, HIDDEN)
    full, _ = attn(x)
    _, past = attn(x[:, :-1], use_cache=True)
    assert past[0].shape == (BATCH, SEQ - 1, HEADS, HEAD)
    last, _ = attn(x[:, -1:], layer_past=past)
    torch.testing.assert_close(last, full[:, -1:], atol=1e-5, rtol=0)


def test_dropout_only_in_training():
    torch.manual_seed(2)
    attn = FlashAttention(HIDDEN, HEADS, attn_pdrop=0.5, fused_qkv=True)
    x = torch.randn(BATCH, SEQ, HIDDEN)
    assert not torch.allclose(attn(x)[0], attn.eval()(x)[0])


def test_refusals():
    with pytest.raises(ValueError, match="not a multiple"):
        FlashAttention(30, 4)
    with pytest.raises(ValueError, match="unknown attn_op_name 'flash3'"):
        FlashAttention(HIDDEN, HEADS, attn_op_name="flash3")
    attn = FlashAttention(HIDDEN, HEADS)
    x = torch.randn(BATCH, SEQ, HIDDEN)
    with pytest.raises(NotImplementedError, match="cross attention"):
        attn(x, encoder_hidden_states=x)
    with pytest.raises(NotImplementedError, match="attention weights"):
        attn(x, output_attentions=True)


def test_core_interface_computes_with_the_modules_core_or_plain_sdpa():
    """hf_core_attention_forward: a module's ``core`` (its scale, causality) decides; a module
    without one gets hf_attention_forward's result."""
    from torch import nn

    from slapo.op import CoreAttention, hf_attention_forward, hf_core_attention_forward

    torch.manual_seed(3)
    q, k, v = (torch.randn(BATCH, HEADS, SEQ, HEAD) for _ in range(3))
    with_core = nn.Module()
    with_core.core = CoreAttention(causal=True, scale=0.5)
    out, weights = hf_core_attention_forward(with_core, q, k, v, None, scaling=1.0)
    scores = (q @ k.transpose(-1, -2) * 0.5).masked_fill(
        torch.ones(SEQ, SEQ).triu(1).bool(), float("-inf"))
    torch.testing.assert_close(out, (scores.softmax(-1) @ v).transpose(1, 2), atol=1e-5, rtol=0)
    assert weights is None
    bare = nn.Module()
    bare.is_causal = False
    torch.testing.assert_close(hf_core_attention_forward(bare, q, k, v, None, scaling=0.3)[0],
                               hf_attention_forward(bare, q, k, v, None, scaling=0.3)[0])
