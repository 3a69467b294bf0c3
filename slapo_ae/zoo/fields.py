"""The rules a model's config fields must meet, per family, checked without torch.

A config that breaks one builds no model (heads that do not divide the hidden size fail in
every rank, after the launch) or a meaningless one (a BERT of no layers trains in no time and
would be recorded ``ok``). Both the zoo's JSON configs (:func:`slapo_ae.zoo.configs.load_config`)
and the overrides of a case (``slapo-bench run --override``, :class:`slapo_ae.case.Case`) are
checked here, before anything runs.

:data:`RULES` maps each family to its fields' rules: ``size`` (an integer of at least 1: a
width, a count of layers, heads, positions or tokens), ``probability`` (a number in [0, 1]:
dropout, layer drop), ``positive`` (a finite number above 0: norm epsilons, RoPE's base),
``non-negative`` (a finite number of at least 0: initialisation spreads), ``token`` (a token
id: an integer in [0, vocab_size)). A field that may be null (the model then derives it) is
``optional``. Any other field whose name says dropout is a probability, as
:func:`slapo_ae.zoo.registry.no_dropout` treats it. :func:`family_checks` adds the rules
between fields (heads dividing the hidden size, GPT-Neo's attention pattern covering its
layers, ...). Field names are the ones transformers gives each config, with its aliases
(T5's ``num_hidden_layers`` is ``num_layers``: :data:`ALIASES`).
"""
from __future__ import annotations

import math
from typing import Any

SIZE, PROBABILITY, POSITIVE, NON_NEGATIVE, TOKEN = (
    "size", "probability", "positive", "non-negative", "token")
OPTIONAL = "optional"  # (kind, OPTIONAL): the field may also be null

_BERT = {
    "vocab_size": SIZE, "hidden_size": SIZE, "num_hidden_layers": SIZE,
    "num_attention_heads": SIZE, "intermediate_size": SIZE, "max_position_embeddings": SIZE,
    "type_vocab_size": SIZE, "hidden_dropout_prob": PROBABILITY,
    "attention_probs_dropout_prob": PROBABILITY, "classifier_dropout": (PROBABILITY, OPTIONAL),
    "layer_norm_eps": POSITIVE, "initializer_range": NON_NEGATIVE,
    "pad_token_id": (TOKEN, OPTIONAL),
}
RULES: dict[str, dict[str, Any]] = {
    "bert": _BERT,
    "roberta": _BERT,
    "gpt_neo": {
        "vocab_size": SIZE, "hidden_size": SIZE, "num_layers": SIZE, "num_heads": SIZE,
        "intermediate_size": (SIZE, OPTIONAL), "max_position_embeddings": SIZE,
        "window_size": SIZE, "embed_dropout": PROBABILITY, "attention_dropout": PROBABILITY,
        "resid_dropout": PROBABILITY, "classifier_dropout": (PROBABILITY, OPTIONAL),
        "layer_norm_epsilon": POSITIVE, "initializer_range": NON_NEGATIVE,
    },
    "opt": {
        "vocab_size": SIZE, "hidden_size": SIZE, "num_hidden_layers": SIZE,
        "num_attention_heads": SIZE, "ffn_dim": SIZE, "max_position_embeddings": SIZE,
        "word_embed_proj_dim": SIZE, "dropout": PROBABILITY, "attention_dropout": PROBABILITY,
        "activation_dropout": PROBABILITY, "layerdrop": PROBABILITY, "init_std": NON_NEGATIVE,
        "pad_token_id": (TOKEN, OPTIONAL),
    },
    "t5": {
        "vocab_size": SIZE, "d_model": SIZE, "d_kv": SIZE, "d_ff": SIZE, "num_layers": SIZE,
        "num_decoder_layers": (SIZE, OPTIONAL), "num_heads": SIZE,
        "relative_attention_num_buckets": SIZE, "relative_attention_max_distance": SIZE,
        "dropout_rate": PROBABILITY, "classifier_dropout": (PROBABILITY, OPTIONAL),
        "layer_norm_epsilon": POSITIVE, "initializer_factor": NON_NEGATIVE,
        "pad_token_id": (TOKEN, OPTIONAL), "decoder_start_token_id": (TOKEN, OPTIONAL),
    },
    "llama": {
        "vocab_size": SIZE, "hidden_size": SIZE, "intermediate_size": SIZE,
        "num_hidden_layers": SIZE, "num_attention_heads": SIZE,
        "num_key_value_heads": (SIZE, OPTIONAL), "head_dim": (SIZE, OPTIONAL),
        "max_position_embeddings": SIZE, "attention_dropout": PROBABILITY,
        "rms_norm_eps": POSITIVE, "rope_theta": POSITIVE, "initializer_range": NON_NEGATIVE,
        "pad_token_id": (TOKEN, OPTIONAL),
    },
    "wideresnet": {
        "width_per_group": SIZE, "groups": SIZE, "base_channels": SIZE, "num_classes": SIZE,
        "in_channels": SIZE, "image_size": SIZE,
    },
}
# transformers' aliases of a family's fields (its config class's attribute_map)
ALIASES = {
    "gpt_neo": {"num_attention_heads": "num_heads", "num_hidden_layers": "num_layers"},
    "t5": {"hidden_size": "d_model", "num_attention_heads": "num_heads",
           "num_hidden_layers": "num_layers", "head_dim": "d_kv"},
}
# the field of the heads that split the hidden size (T5's heads have their own width, d_kv;
# LLaMA's too where its config gives head_dim)
HEADS = {"bert": "num_attention_heads", "roberta": "num_attention_heads",
         "opt": "num_attention_heads", "llama": "num_attention_heads", "gpt_neo": "num_heads"}
# the field naming each family's activation, as the built config holds it, and the JSON field
# it comes from: a name transformers does not know is refused where the config is built
# (slapo_ae.zoo.registry.hf_config, which has transformers at hand)
ACTIVATIONS = {"bert": ("hidden_act", "hidden_act"), "roberta": ("hidden_act", "hidden_act"),
               "llama": ("hidden_act", "hidden_act"),
               "gpt_neo": ("activation_function", "activation_function"),
               "opt": ("activation_function", "activation_function"),
               "t5": ("dense_act_fn", "feed_forward_proj")}
_MEANING = {
    SIZE: "a positive integer (a size or count)",
    PROBABILITY: "a probability in [0, 1]",
    POSITIVE: "a finite number above 0",
    NON_NEGATIVE: "a finite number of at least 0",
    TOKEN: "a token id in [0, vocab_size)",
}


class FieldError(ValueError):
    """A config field that breaks its rule; ``fields`` are the fields the rule is about (the
    first the one to blame, where one is)."""

    def __init__(self, fields: tuple[str, ...], message: str):
        self.fields = fields
        super().__init__(message)


def canonical(family: str, field: str) -> str:
    """The name a family's config stores ``field`` under (its alias resolved)."""
    return ALIASES.get(family, {}).get(field, field)


def rule(family: str, field: str) -> tuple[str, bool] | None:
    """``(kind, optional)`` of a family's field, None where no rule holds it."""
    found = RULES.get(family, {}).get(canonical(family, field))
    if found is None and ("dropout" in field or field == "layerdrop"):
        found = PROBABILITY
    if found is None:
        return None
    return (found[0], True) if isinstance(found, tuple) else (found, False)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def _meets(kind: str, value) -> bool:
    if kind in (SIZE, TOKEN):
        return _is_int(value) and value >= (1 if kind == SIZE else 0)
    if not _is_real(value):
        return False
    if kind == PROBABILITY:
        return 0 <= value <= 1
    return value > 0 if kind == POSITIVE else value >= 0


def check_field(family: str, field: str, value) -> None:
    """Raise :class:`FieldError` if ``value`` breaks the rule of ``field`` (none: no check)."""
    found = rule(family, field)
    if found is None:
        return
    kind, optional = found
    if value is None and optional:
        return
    if not _meets(kind, value):
        name = canonical(family, field)
        shown = name if name == field else f"{name} ({field})"
        raise FieldError((field,), f"{shown} must be {_MEANING[kind]}, got {value!r}")


def _divides(fields: dict, part: str, whole: str, why: str) -> None:
    a, b = fields.get(part), fields.get(whole)
    if _is_int(a) and _is_int(b) and a >= 1 and b % a:
        raise FieldError((part, whole), f"{part} {a} does not divide {whole} {b} ({why})")


def family_checks(family: str, fields: dict) -> None:
    """The rules between a family's fields (their own rules already met)."""
    heads = HEADS.get(family)
    if heads and not (family == "llama" and fields.get("head_dim") is not None):
        _divides(fields, heads, "hidden_size", f"each head takes hidden_size / {heads}")
    if family == "llama" and fields.get("num_key_value_heads") is not None:
        _divides(fields, "num_key_value_heads", "num_attention_heads",
                 "each key/value head serves the same number of query heads")
    vocab = fields.get("vocab_size")
    for token in ("pad_token_id", "decoder_start_token_id"):
        value = fields.get(token)
        if rule(family, token) and _is_int(value) and _is_int(vocab) and value >= vocab:
            raise FieldError((token, "vocab_size"),
                             f"{token} {value} is not below vocab_size {vocab} (the "
                             "embedding has no row for it)")
    if family == "roberta":
        positions, pad = fields.get("max_position_embeddings"), fields.get("pad_token_id") or 0
        if _is_int(positions) and positions <= pad + 1:
            raise FieldError(("max_position_embeddings", "pad_token_id"),
                             f"max_position_embeddings {positions} leaves no position: "
                             f"RoBERTa counts positions from pad_token_id + 1 = {pad + 1}")
    if family == "gpt_neo":
        _check_attention_types(fields)
    if family == "wideresnet":
        _check_wideresnet(fields)


def _check_attention_types(fields: dict) -> None:
    """GPT-Neo's ``attention_types``: ``[[["global", "local"], repeats], ...]``, which must
    name one kind per layer (transformers refuses the config otherwise)."""
    types, layers = fields.get("attention_types"), fields.get("num_layers")
    shape = ('attention_types must be a list of [[kinds...], repeats] with kinds "global" or '
             '"local"')
    if not isinstance(types, list):
        raise FieldError(("attention_types",), f"{shape}, got {types!r}")
    count = 0
    for item in types:
        if (not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], list)
                or not all(kind in ("global", "local") for kind in item[0])
                or not _is_int(item[1]) or item[1] < 1):
            raise FieldError(("attention_types",), f"{shape}, got {item!r} in it")
        count += len(item[0]) * item[1]
    if _is_int(layers) and count != layers:
        raise FieldError(("num_layers", "attention_types"),
                         f"num_layers {layers} is not the {count} layers attention_types "
                         "names (one kind of attention per layer)")


def _check_wideresnet(fields: dict) -> None:
    layers = fields.get("layers")
    if (not isinstance(layers, list) or not layers
            or not all(_is_int(n) and n >= 1 for n in layers)):
        raise FieldError(("layers",), "layers must be a non-empty list of positive integers "
                                      f"(bottleneck blocks per stage), got {layers!r}")
    base, per_group = fields.get("base_channels"), fields.get("width_per_group")
    if _is_int(base) and _is_int(per_group) and base * per_group // 64 < 1:
        raise FieldError(("width_per_group", "base_channels"),
                         f"base_channels {base} x width_per_group {per_group} / 64 gives the "
                         "first stage's blocks no width")


def check(family: str, fields: dict) -> None:
    """Raise :class:`FieldError` for the first rule that ``fields`` (a family's whole config)
    breaks: each field's own rule, then the rules between fields."""
    for field, value in fields.items():
        check_field(family, field, value)
    family_checks(family, fields)


def merged(family: str, fields: dict, overrides: dict) -> dict:
    """``fields`` with ``overrides`` applied under their canonical names (aliases resolved)."""
    out = dict(fields)
    for key, value in overrides.items():
        out[canonical(family, key)] = value
    return out
