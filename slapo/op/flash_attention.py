"""``FlashAttention``: upstream Slapo's self-attention module, computed with
``scaled_dot_product_attention`` (``slapo.op.attention``), and ``FlashAttentionOp``, its
attention core under upstream's name, arguments and call (``op(q, k, v, mask, p)`` on
``[B, S, H, D]`` tensors; ``slapo.op.attention.FlashAttentionOp`` too), which upstream's
schedules keep as a leaf when they trace (``leaf_modules=["FlashAttentionOp"]``) and subclass.

Upstream chose among xFormers, flash-attention (Triton or CUDA) and reference kernels by
``attn_op_name``. Those packages are not part of this stack: every name upstream accepted is
taken and computed by SDPA, which picks its cuDNN, flash or memory-efficient kernel on CUDA
(``attn_op_name`` is kept on the module, for records). The constructor arguments, the
forward signature, the outputs and the parameter names (``qkv`` or ``query``/``key``/
``value``, ``out_proj``) are upstream's, so its schedules find what they shard:

    sch["attn.qkv"].shard("weight", axis=0)          # this rank's heads of q, k and v
    sch["attn.qkv"].sync("bwd_post", "all_reduce")
    sch["attn.out_proj"].shard("weight", axis=1)
    sch["attn.out_proj"].sync("fwd_post", "all_reduce")
    sch["attn.attn_op"].fork_rng()                    # probability dropout per rank

The fused projection lays its output features out head by head, each head's q, k and v
side by side (upstream's layout), so a shard of ``qkv`` along axis 0 keeps whole heads of all
three; the forward reads the number of heads from the tensors, so it needs no change after
sharding.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import state
from .sdpa import attention

# upstream's names: xFormers ops ("auto" lets it choose), flash-attention kernels, references
ATTN_OP_NAMES = ("auto", "cutlass", "flash", "triton", "small_k", "cuda", "native_xformers",
                 "native_flash_attn")


@state.leaf_class  # a kernel: traces keep it one call, as upstream's schedules ask
class FlashAttentionOp(nn.Module):
    """The attention core: ``op(query, key, value, attention_mask, p)`` on ``[B, S, H, D]``
    tensors, returning ``[B, S, H, D]`` in the query's dtype. ``attention_mask``: boolean (True
    = attend) or additive, broadcastable to ``[B, H, S_q, S_k]``; ``apply_causal_mask``: causal
    attention; ``scale``: of the scores (default ``1/sqrt(D)``); ``p``: dropout on the
    probabilities, in training mode only (upstream applied it in eval mode too)."""

    def __init__(self, attn_op_name: str = "auto", apply_causal_mask: bool = False,
                 scale: float | None = None):
        super().__init__()
        if attn_op_name not in ATTN_OP_NAMES:
            raise ValueError(f"FlashAttentionOp: unknown attn_op_name {attn_op_name!r}; "
                             f"expected one of {', '.join(ATTN_OP_NAMES)} (all computed by "
                             "SDPA)")
        self.attn_op_name, self.apply_causal_mask, self.scale = (attn_op_name,
                                                                 apply_causal_mask, scale)

    def forward(self, query_layer: torch.Tensor, key_layer: torch.Tensor,
                value_layer: torch.Tensor, attention_mask: torch.Tensor | None = None,
                p: float = 0.0) -> torch.Tensor:
        out = attention(query_layer.transpose(1, 2), key_layer.transpose(1, 2),
                        value_layer.transpose(1, 2), attention_mask,
                        causal=self.apply_causal_mask, scale=self.scale,
                        dropout_p=p if self.training else 0.0)
        return out.transpose(1, 2).to(query_layer.dtype)

    def extra_repr(self) -> str:
        return (f"attn_op_name={self.attn_op_name!r}, apply_causal_mask="
                f"{self.apply_causal_mask}, scale={self.scale}")


class FlashAttention(nn.Module):
    """Multi-head self-attention: projections, SDPA, and (with ``output_proj``) the output
    projection and its dropout.

    ``attn_pdrop``: dropout on the attention probabilities (training only); ``resid_pdrop``:
    dropout after ``out_proj``; ``bias``: biases of the projections; ``fused_qkv``: one
    ``qkv`` linear instead of ``query``, ``key`` and ``value``; ``attn_op_name``: any of
    ``ATTN_OP_NAMES``, all computed by SDPA. As upstream, the attention is causal exactly when
    ``output_proj`` is set (a decoder's self-attention, GPT style); without it the module is
    an encoder's self-attention core whose output projection lies elsewhere (BERT style).
    """

    def __init__(self, hidden_size: int, num_attention_heads: int, attn_pdrop: float = 0.0,
                 resid_pdrop: float = 0.0, attn_op_name: str = "auto", bias: bool = True,
                 output_proj: bool = True, fused_qkv: bool = False, world_size: int = 1):
        # world_size: an older upstream's, taken and unused: the forward reads this rank's
        # heads from the tensors
        super().__init__()
        if hidden_size % num_attention_heads:
            raise ValueError(f"FlashAttention: hidden size {hidden_size} is not a multiple of "
                             f"the number of attention heads ({num_attention_heads})")
        if attn_op_name not in ATTN_OP_NAMES:
            raise ValueError(f"FlashAttention: unknown attn_op_name {attn_op_name!r}; expected "
                             f"one of {', '.join(ATTN_OP_NAMES)} (all computed by SDPA)")
        self.hidden_size, self.num_attention_heads = hidden_size, num_attention_heads
        self.attention_head_size = hidden_size // num_attention_heads
        self.fused_qkv, self.output_proj = fused_qkv, output_proj
        self.attn_pdrop, self.attn_op_name = attn_pdrop, attn_op_name
        if fused_qkv:
            self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=bias)
        else:
            self.query = nn.Linear(hidden_size, hidden_size, bias=bias)
            self.key = nn.Linear(hidden_size, hidden_size, bias=bias)
            self.value = nn.Linear(hidden_size, hidden_size, bias=bias)
        if output_proj:
            self.out_proj = nn.Linear(hidden_size, hidden_size, bias=bias)
            self.resid_dropout = nn.Dropout(resid_pdrop)
        self.attn_op = FlashAttentionOp(attn_op_name, apply_causal_mask=output_proj)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, S, H * D] -> [B, S, H, D]; H from the tensor (this rank's heads)."""
        return x.view(x.shape[:-1] + (-1, self.attention_head_size))

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                layer_past: tuple[torch.Tensor, torch.Tensor] | None = None,
                head_mask: torch.Tensor | None = None,
                encoder_hidden_states: torch.Tensor | None = None,
                encoder_attention_mask: torch.Tensor | None = None,
                use_cache: bool = False, output_attentions: bool = False):
        """``hidden_states`` ``[B, S, hidden]``; ``attention_mask`` boolean (True = attend) or
        additive float, broadcastable to ``[B, H, S_q, S_k]`` (HF's ``[B, 1, 1, S]`` extended
        mask included); ``layer_past`` ``(key, value)`` ``[B, S_past, H, D]``, as returned.
        Returns ``(output, (key, value) if use_cache else None)``. Cross attention, head masks
        and attention weights are refused, as upstream refuses them."""
        if encoder_hidden_states is not None or encoder_attention_mask is not None:
            raise NotImplementedError("FlashAttention does not support cross attention")
        if output_attentions:
            raise NotImplementedError("FlashAttention does not return attention weights")
        if head_mask is not None:
            raise NotImplementedError("FlashAttention does not support a head mask")
        if self.fused_qkv:
            fused = self.qkv(hidden_states)
            # shapes as tuples and splits indexed, not unpacked: traced without example
            # inputs, as upstream's schedules trace it, a shape or split is one value
            fused = fused.view(fused.shape[:-1] + (-1, 3 * self.attention_head_size))
            parts = fused.split(self.attention_head_size, dim=-1)
            query, key, value = parts[0], parts[1], parts[2]
        else:
            query, key, value = (self._heads(proj(hidden_states))
                                 for proj in (self.query, self.key, self.value))
        if layer_past is not None:
            key = torch.cat((layer_past[0], key), dim=1)
            value = torch.cat((layer_past[1], value), dim=1)
        context = self.attn_op(query, key, value, attention_mask, self.attn_pdrop)
        context = context.reshape(hidden_states.shape[:-1] + (-1,))
        if self.output_proj:
            context = self.resid_dropout(self.out_proj(context))
        return context, ((key, value) if use_cache else None)
