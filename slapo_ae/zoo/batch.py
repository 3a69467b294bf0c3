"""Synthetic training batches: the keyword arguments of a forward that returns a loss.

Every model of the zoo is called as `out = model(**batch)` and returns an object with
`out.loss` (also `out["loss"]`, `out[0]`):

| family                   | batch keys                                  | shapes                 |
|--------------------------|---------------------------------------------|------------------------|
| bert, roberta (MLM)      | input_ids, attention_mask, labels           | [B, S] each            |
| gpt_neo, opt, llama (LM) | input_ids, attention_mask, labels           | [B, S] each            |
| t5                       | input_ids, attention_mask (encoder), labels | [B, S], [B, S], [B, D] |
| wideresnet               | pixel_values, labels                        | [B, 3, H, H], [B]      |

Token ids are uniform in [0, vocab) and `labels = input_ids` (causal LMs shift inside the model;
the MLM loss is taken over every token, which costs the same as masking 15%). T5's decoder
inputs are made by the model from `labels`. Images are standard normal, labels uniform
classes. Everything comes from a CPU `torch.Generator` seeded with `seed`, so a batch is the
same on every device and every rank that uses the same seed.
"""

from __future__ import annotations

from typing import Any

import torch

from .configs import FAMILIES, load_config


def _family_and_fields(name_or_config: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(name_or_config, str):
        name_or_config = load_config(name_or_config)
    # a config object (transformers PretrainedConfig or WideResNetConfig) or a JSON dict
    fields = name_or_config if isinstance(name_or_config, dict) else name_or_config.to_dict()
    family = fields["model_type"]  # the zoo's family names are the HF model types
    if family not in FAMILIES:
        raise ValueError(f"no synthetic batch for model type {family!r}; known: {FAMILIES}")
    return family, fields


def synthetic_batch(
    name_or_config: Any,
    batch_size: int,
    seq_len: int,
    dec_seq_len: int = 0,
    *,
    device: str | torch.device = "cpu",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Keyword arguments for one training forward of the model.

    `name_or_config`: a zoo name, its `load_config` dict, or a config object (`model.config`).
    `seq_len` is the (encoder) sequence length, ignored for WideResNet (image side comes from
    the config's `image_size`); `dec_seq_len` is T5's decoder length (required > 0 for T5).
    `dtype` applies to floating inputs only (images).
    """
    family, fields = _family_and_fields(name_or_config)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    device = torch.device(device)

    if family == "wideresnet":
        side, channels = fields["image_size"], fields["in_channels"]
        images = torch.randn(batch_size, channels, side, side, generator=gen, dtype=torch.float32)
        labels = torch.randint(0, fields["num_classes"], (batch_size,), generator=gen)
        return {"pixel_values": images.to(device=device, dtype=dtype), "labels": labels.to(device)}

    vocab = fields["vocab_size"]
    input_ids = torch.randint(0, vocab, (batch_size, seq_len), generator=gen)
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    if family == "t5":
        if dec_seq_len <= 0:
            raise ValueError("T5 needs a decoder length: pass dec_seq_len > 0")
        batch["labels"] = torch.randint(0, vocab, (batch_size, dec_seq_len), generator=gen)
    else:
        batch["labels"] = input_ids.clone()
    return {k: v.to(device) for k, v in batch.items()}
