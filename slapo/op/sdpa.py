"""Attention through ``torch.nn.functional.scaled_dot_product_attention`` (SDPA).

One function, ``attention``, covers what the model families of the paper need:

- padding masks, boolean (``True`` = attend) or additive float (HF's eager masks: 0 / dtype min);
- causal masks, aligned to the bottom right as HF does (query ``i`` of ``Q`` sees key ``j`` when
  ``j <= i + K - Q``);
- GPT-Neo's local attention: a causal window of ``window`` keys (``i - j < window``) and no
  ``1/sqrt(d)`` scaling (``scale=1.0``); on CUDA, with nothing padded and a sequence of whole
  windows, by chunks of the window (``local_attention``: 0.44 of the work of the dense masked
  call at 1024 tokens and window 256);
- T5's relative position bias, an additive ``bias`` broadcast to ``[B, H, Q, K]`` (``scale=1.0``);
- grouped-query attention (fewer key/value heads than query heads);
- dropout on the attention probabilities (``dropout_p``), drawn from the current default
  generator, so ``fork_rng`` and ``checkpoint`` control it as they control ``nn.Dropout``.

When no mask, bias or window is needed and ``Q == K``, SDPA gets ``is_causal`` and no mask, which
lets CUDA run its flash or cuDNN kernel: which one is measured on the device at the first call
of each shape (``sdpa_backend``); otherwise the masks are merged into one tensor (boolean when all
parts are boolean, additive float otherwise) and SDPA picks a kernel that takes a mask (cuDNN's
where PyTorch prefers it, the memory-efficient one, or math).
On CPU with dropout, SDPA can only use its math kernel, whose dropout draws a ``bernoulli_``
mask; ``attention`` then computes the same math itself with ``slapo.op.dropout``'s CPU kernel
(measured here, batch 8, 4 heads, seq 128: 7.1 ms forward + backward against SDPA's 9.2 ms).

A query row left with no key to attend to (possible only when padding meets a causal or local
window, e.g. left padding) gets zeros, SDPA's convention; HF's eager code averages such rows
instead. They are padding positions, which carry no loss.

``hf_attention_forward`` adapts ``attention`` to transformers' attention interface; registered
under ``SLAPO_ATTENTION`` (``register_hf_attention``), a model whose configs name it runs every
interface-based attention (BERT, RoBERTa, OPT, LLaMA, T5) through this file. ``CoreAttention``
wraps ``attention`` in a module for attention code that does not use the interface (GPT-Neo).
``hf_core_attention_forward`` (``SLAPO_CORE_ATTENTION``, ``register_hf_core_attention``) is the
interface computed by the attention module's own ``core`` child, a ``CoreAttention``: the
attention core is then a node of the schedule (GPT-2, to ``fork_rng`` its dropout).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import sdpa_backend
from .dropout import dropout

BANDED_ON = ("cuda",)  # where a local window is computed by chunks (local_attention)
SLAPO_ATTENTION = "slapo_sdpa"
SLAPO_CORE_ATTENTION = "slapo_sdpa_core"


def _structural_mask(q_len: int, k_len: int, causal: bool, window: int | None,
                     device) -> torch.Tensor | None:
    """Boolean [Q, K] mask of causality and the local window (None when neither applies)."""
    if not causal and window is None:
        return None
    q_pos = torch.arange(q_len, device=device)[:, None] + (k_len - q_len)
    k_pos = torch.arange(k_len, device=device)[None, :]
    keep = k_pos <= q_pos  # a local window is causal too (GPT-Neo)
    if window is not None:
        keep = keep & (q_pos - k_pos < window)
    return keep


def merge_masks(q_len: int, k_len: int, dtype: torch.dtype, device, mask=None, bias=None,
                causal: bool = False, window: int | None = None) -> torch.Tensor | None:
    """One SDPA ``attn_mask`` from a padding mask, an additive bias, causality and a window.

    Boolean when every part is boolean, else additive in ``dtype`` (masked entries get the
    dtype's minimum, as HF's eager masks do, so no row becomes all ``-inf``).
    """
    structural = _structural_mask(q_len, k_len, causal, window, device)
    parts_bool = [m for m in (mask, structural) if m is not None and m.dtype == torch.bool]
    keep = None
    for part in parts_bool:
        keep = part if keep is None else keep & part
    float_mask = mask if mask is not None and mask.dtype != torch.bool else None
    if bias is None and float_mask is None:
        return keep
    additive = bias.to(dtype) if bias is not None else None
    if float_mask is not None:
        float_mask = float_mask.to(dtype)
        additive = float_mask if additive is None else additive + float_mask
    if keep is not None:
        # torch.where, not masked_fill: for T5's bias (one for the whole batch) inside a
        # compiled T5 block, Inductor's masked_fill gave the bias a wrong gradient (torch
        # 2.13, CPU; tests/distributed/test_sched_compile.py)
        additive = torch.where(keep, additive, torch.finfo(dtype).min)
    return additive


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              mask: torch.Tensor | None = None, *, bias: torch.Tensor | None = None,
              causal: bool = False, window: int | None = None, scale: float | None = None,
              dropout_p: float = 0.0) -> torch.Tensor:
    """Scaled dot-product attention on ``[B, H, Q, D]`` queries and ``[B, Hkv, K, D]`` keys and
    values; returns ``[B, H, Q, D]``.

    ``mask``: boolean (True = attend) or additive float, broadcastable to ``[B, H, Q, K]``.
    ``bias``: additive float scores (T5's relative position bias). ``causal``: bottom-right
    aligned causal mask. ``window``: local causal attention over the last ``window`` keys.
    ``scale``: multiplies ``q @ k^T`` (default ``1/sqrt(D)``; GPT-Neo and T5 use 1.0).
    ``dropout_p``: dropout on the probabilities (pass 0 in evaluation).
    ``Hkv`` may divide ``H`` (grouped-query attention).
    """
    q_len, k_len = query.shape[-2], key.shape[-2]
    if dropout_p > 0.0 and query.device.type == "cpu":
        attn_mask = merge_masks(q_len, k_len, query.dtype, query.device, mask, bias, causal,
                                window)
        return math_attention(query, key, value, attn_mask, scale, dropout_p)
    if mask is None and bias is None and window is None and (not causal or q_len == k_len):
        return scaled_dot_product_attention(query, key, value, dropout_p=dropout_p,
                                            is_causal=causal and q_len > 1, scale=scale)
    if (window is not None and mask is None and bias is None and q_len == k_len > window
            and q_len % window == 0 and query.device.type in BANDED_ON):
        return local_attention(query, key, value, window, scale, dropout_p)
    attn_mask = merge_masks(q_len, k_len, query.dtype, query.device, mask, bias, causal, window)
    return scaled_dot_product_attention(query, key, value, attn_mask, dropout_p=dropout_p,
                                        scale=scale)


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                                 is_causal: bool = False,
                                 scale: float | None = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` (grouped-query attention when the key has fewer
    heads), on a device where ``sdpa_backend`` measures on the kernel measured fastest for
    the call's shapes, strides, mask and the dtype SDPA computes in (autocast casts its
    inputs). Under ``torch.compile`` the shapes must be static (the schedules compile with
    ``dynamic=False``): Dynamo breaks the graph at a call with dynamic sizes."""
    kwargs = {"attn_mask": attn_mask, "dropout_p": dropout_p, "is_causal": is_causal,
              "scale": scale, "enable_gqa": key.shape[-3] != query.shape[-3]}
    device_type = query.device.type
    if not sdpa_backend.measures(device_type):
        return F.scaled_dot_product_attention(query, key, value, **kwargs)
    dtype = query.dtype
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    mask = None
    if attn_mask is not None:
        mask = (tuple(attn_mask.shape), str(attn_mask.dtype).removeprefix("torch."),
                attn_mask.requires_grad)
    order = sdpa_backend.backend_order(
        query.shape[0], query.shape[-3], key.shape[-3], query.shape[-2], key.shape[-2],
        query.shape[-1], (query.stride(), key.stride(), value.stride()),
        str(dtype).removeprefix("torch."), str(query.device), is_causal, float(dropout_p),
        scale, mask)
    if not order:
        return F.scaled_dot_product_attention(query, key, value, **kwargs)
    priority = [getattr(SDPBackend, name) for name in order]
    if SDPBackend.MATH not in priority:
        priority.append(SDPBackend.MATH)
    with sdpa_kernel(priority, set_priority=True):
        return F.scaled_dot_product_attention(query, key, value, **kwargs)


def local_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, window: int,
                    scale: float | None = None, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention over the last ``window`` keys (GPT-Neo's local layers) of a sequence
    of ``S`` queries and keys, ``S`` a multiple of ``window``, computed by chunks of
    ``window`` queries: the first chunk is plain causal attention; chunk ``c`` attends to the
    keys of chunks ``c - 1`` and ``c`` under one band mask ``[W, 2W]`` (key ``b`` of the pair
    is kept for query ``a`` when ``a < b <= a + W``), all of them in one SDPA call with the
    chunks as batch. What each query sees is the window's mask; the kernel works on
    ``W * 2W`` scores a chunk instead of ``S * S`` a sequence (GPT-Neo-1.3B at 1024 tokens,
    window 256: 0.44 of the dense work)."""
    batch, _, length, _ = query.shape
    chunks = length // window
    chunk0 = slice(0, window)
    first = scaled_dot_product_attention(query[:, :, chunk0], key[:, :, chunk0],
                                         value[:, :, chunk0], dropout_p=dropout_p,
                                         is_causal=True, scale=scale)

    def as_batch(t):  # [B, h, n, L, D] -> [B * n, h, L, D]
        return t.transpose(1, 2).flatten(0, 1)

    def pairs(t):  # chunk c - 1 then chunk c, for c >= 1
        t = t.unflatten(2, (chunks, window))
        return as_batch(torch.cat([t[:, :, :-1], t[:, :, 1:]], dim=3))

    later = as_batch(query[:, :, window:].unflatten(2, (chunks - 1, window)))
    a = torch.arange(window, device=query.device)[:, None]
    b = torch.arange(2 * window, device=query.device)[None, :]
    rest = scaled_dot_product_attention(later, pairs(key), pairs(value),
                                        (b > a) & (b <= a + window), dropout_p=dropout_p,
                                        scale=scale)
    rest = rest.unflatten(0, (batch, chunks - 1)).transpose(1, 2).flatten(2, 3)
    return torch.cat([first, rest], dim=2)


def math_attention(query, key, value, attn_mask=None, scale=None, dropout_p=0.0):
    """SDPA's math kernel written out, with the probabilities' dropout by
    :func:`slapo.op.dropout.dropout` (its CPU kernel). ``attn_mask``: boolean (True = attend)
    or additive, as SDPA takes it; a query row with no key to attend to gets zeros, as SDPA's."""
    if key.shape[-3] != query.shape[-3]:  # grouped-query attention: share each key/value head
        groups = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(groups, -3), value.repeat_interleave(groups, -3)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(query, key.transpose(-2, -1)) * scale
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        probs = scores.masked_fill(~attn_mask, float("-inf")).softmax(-1).nan_to_num(0.0)
    else:
        probs = (scores if attn_mask is None else scores + attn_mask).softmax(-1)
    return torch.matmul(dropout(probs, dropout_p), value)


def hf_attention_forward(module: nn.Module, query, key, value, attention_mask, dropout=0.0,
                         scaling=None, is_causal=None, position_bias=None, **kwargs):
    """transformers' attention-interface signature on top of ``attention``.

    A mask built by the model already holds causality, so ``module.is_causal`` only applies
    when the model passed no mask (HF's SDPA masks are None when nothing is padded).
    Returns ``(output [B, Q, H, D], None)``: attention weights are never materialised.
    """
    if kwargs.get("output_attentions"):
        raise ValueError("slapo's SDPA attention does not return attention weights")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", False)
    causal = bool(causal) and attention_mask is None and query.shape[-2] > 1
    out = attention(query, key, value, attention_mask, bias=position_bias, causal=causal,
                    scale=scaling, dropout_p=dropout)
    return out.transpose(1, 2).contiguous(), None


def hf_core_attention_forward(module: nn.Module, query, key, value, attention_mask, dropout=0.0,
                              scaling=None, **kwargs):
    """transformers' attention-interface signature computed by ``module.core`` (a
    ``CoreAttention`` holding the layer's causality, scale and probability dropout; the
    interface's ``dropout`` and ``scaling`` are those of the core). A mask built by the model
    holds causality already; the core's causal mask then changes nothing. An attention module
    without a core (one the schedule left alone, e.g. a cross attention) runs through
    ``hf_attention_forward``. Returns ``(output [B, Q, H, D], None)``."""
    core = getattr(module, "core", None)
    if not isinstance(core, CoreAttention):
        return hf_attention_forward(module, query, key, value, attention_mask, dropout,
                                    scaling, **kwargs)
    if kwargs.get("output_attentions"):
        raise ValueError("slapo's SDPA attention does not return attention weights")
    return core(query, key, value, attention_mask).transpose(1, 2).contiguous(), None


def _register(name: str, fn) -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def register_hf_attention() -> str:
    """Register ``hf_attention_forward`` (with HF's SDPA mask builder) in transformers under
    ``SLAPO_ATTENTION``; idempotent. Returns the name to put in ``config._attn_implementation``."""
    return _register(SLAPO_ATTENTION, hf_attention_forward)


def register_hf_core_attention() -> str:
    """Register ``hf_core_attention_forward`` (with HF's SDPA mask builder) under
    ``SLAPO_CORE_ATTENTION``; idempotent. Returns the name for ``config._attn_implementation``."""
    return _register(SLAPO_CORE_ATTENTION, hf_core_attention_forward)


class CoreAttention(nn.Module):
    """``attention`` as a module: ``core(q, k, v, mask=None, bias=None)`` on ``[B, H, S, D]``.

    Holds the fixed choices of a layer (causal, local window, scale, probability dropout), so
    that a schedule can address the attention core as a node, e.g. to ``fork_rng`` it.
    Dropout applies in training mode only.
    """

    def __init__(self, causal: bool = False, window: int | None = None,
                 scale: float | None = None, dropout: float = 0.0):
        super().__init__()
        self.causal, self.window, self.scale, self.dropout = causal, window, scale, dropout

    def forward(self, query, key, value, mask=None, bias=None):
        return attention(query, key, value, mask, bias=bias, causal=self.causal,
                         window=self.window, scale=self.scale,
                         dropout_p=self.dropout if self.training else 0.0)

    def extra_repr(self) -> str:
        return (f"causal={self.causal}, window={self.window}, scale={self.scale}, "
                f"dropout={self.dropout}")


def _configs(module: nn.Module) -> list:
    seen = {}
    for sub in module.modules():
        config = getattr(sub, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            seen[id(config)] = config
    return list(seen.values())


def use_sdpa(sch) -> None:
    """Run the attention of every module below ``sch`` that dispatches through transformers'
    attention interface (BERT, RoBERTa, OPT, LLaMA, T5) through ``attention``; masks
    are then built as for HF's SDPA path (boolean, or None when nothing is padded)."""
    name = register_hf_attention()
    for config in _configs(sch.mod):
        config._attn_implementation = name
