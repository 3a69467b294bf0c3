"""Small modules and their Megatron-style TP=2 schedules, for the core's proofs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLPBlock(nn.Module):
    """x + fc2(gelu(fc1(norm(x)))): the norm upstream gives the input-gradient sync a job."""

    def __init__(self, hidden: int = 32, ffn: int = 128):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class MLP(nn.Module):
    """fc2(gelu(fc1(x))), upstream's MLP of its sharding tests (no norm, no residual)."""

    def __init__(self, hidden: int = 32, ffn: int = 128):
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def schedule_mlp(sch, input_grad_sync: bool = True) -> None:
    sch["fc1"].shard("weight", axis=0)
    if input_grad_sync:
        sch["fc1"].sync("bwd_post", "all_reduce")
    sch["fc2"].shard("weight", axis=1)
    sch["fc2"].sync("fwd_post", "all_reduce")


class SelfAttention(nn.Module):
    """Multi-head attention whose head count follows the (possibly sharded) projections."""

    def __init__(self, hidden: int = 32, heads: int = 4):
        super().__init__()
        self.head_dim = hidden // heads
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x, mask=None):
        b, s, _ = x.shape
        split = lambda t: t.view(b, s, -1, self.head_dim).transpose(1, 2)  # noqa: E731
        ctx = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)),
                                             split(self.v(x)), attn_mask=mask)
        return self.out(ctx.transpose(1, 2).reshape(b, s, -1))


class AttentionBlock(nn.Module):
    def __init__(self, hidden: int = 32, heads: int = 4):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.attn = SelfAttention(hidden, heads)

    def forward(self, x, mask=None):
        return x + self.attn(self.norm(x), mask=mask)


def schedule_attention(sch) -> None:
    for name in ("q", "k", "v"):
        sch[f"attn.{name}"].shard("weight", axis=0)
    sch["attn"].sync("bwd_post", "all_reduce")
    sch["attn.out"].shard("weight", axis=1)
    sch["attn.out"].sync("fwd_post", "all_reduce")


def small_bert_config(**overrides):
    from transformers import BertConfig

    fields = dict(vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=512, max_position_embeddings=128,
                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertConfig(**{**fields, **overrides})


def bert_batch(config, step: int, batch: int = 4, seq: int = 32) -> dict:
    gen = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=gen)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, seq // 2:] = 0  # one padded sequence
    labels = ids.masked_fill(torch.rand(batch, seq, generator=gen) > 0.3, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
