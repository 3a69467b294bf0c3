"""The model zoo's configs, read without torch: names, families and JSON fields.

A model is named as on the HF hub (`bert-large-uncased`, `EleutherAI/gpt-neo-2.7B`) or as a
paper variant (`bert-xlarge`, `wideresnet-2.4B`); its config lives at
`<config dir>/<name>.json`, the config dir being `configs/models` of this checkout
(`slapo_ae.paths.MODEL_CONFIGS`) or the folder named by `$SLAPO_MODEL_CONFIGS`.

Each JSON holds the model's real config fields plus one project key:

    "_slapo": {"family": "bert" | "roberta" | "gpt_neo" | "opt" | "t5" | "llama" | "wideresnet",
               "hf_class": "BertForMaskedLM" (a transformers class) or "pkg.module.Class",
               "description": "...", "paper_label": "BERT-1B" (optional)}

This is the one reader of those files: the planner (at DAG time), the analysis and the
harness all ask it. It holds them, and a case's overrides of them (`check_overrides`), to the
rules of `fields.py`.
"""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path
from typing import Any

from slapo_ae import paths, textfile
from slapo_ae.zoo import fields

FAMILIES = ("bert", "roberta", "gpt_neo", "opt", "t5", "llama", "wideresnet")
ENV_CONFIG_DIR = "SLAPO_MODEL_CONFIGS"
PROJECT_KEY = "_slapo"


def config_dir() -> Path:
    """The folder of model configs: `$SLAPO_MODEL_CONFIGS` if set, else `<repo>/configs/models`."""
    if env := os.environ.get(ENV_CONFIG_DIR):
        return Path(env)
    return paths.MODEL_CONFIGS


def list_models(family: str | None = None) -> list[str]:
    """Sorted names of all models in the zoo (optionally of one family)."""
    root = config_dir()
    names = sorted(p.relative_to(root).with_suffix("").as_posix() for p in root.rglob("*.json"))
    if family is not None:
        names = [n for n in names if model_family(n) == family]
    return names


def _config_path(name: str) -> Path:
    path = config_dir() / f"{name}.json"
    if not path.is_file():
        known = list_models()
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.4)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise KeyError(f"unknown model {name!r}.{hint} Known models: {', '.join(known)}")
    return path


def load_config(name: str) -> dict[str, Any]:
    """The model's JSON config as a dict, the `_slapo` section included.

    Raises `KeyError` (listing known names) for an unknown model and `ValueError` naming the
    file for a file that is not UTF-8 text, malformed JSON, a missing/invalid `_slapo` section
    or a field that breaks its rule (`fields.py`: a BERT of no layers, heads that do not
    divide the hidden size, ...).
    """
    path = _config_path(name)
    try:
        cfg = json.loads(textfile.read_text(path))
    except textfile.NotTextError as e:
        raise ValueError(f"malformed model config {e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"malformed model config {path}: {e}") from e
    meta = cfg.get(PROJECT_KEY) if isinstance(cfg, dict) else None
    if not isinstance(meta, dict) or meta.get("family") not in FAMILIES or not meta.get("hf_class"):
        raise ValueError(
            f"model config {path} needs a {PROJECT_KEY!r} object with 'hf_class' and a 'family' "
            f"among {FAMILIES}"
        )
    if "model_type" not in cfg:
        raise ValueError(f"model config {path} has no 'model_type'")
    try:
        fields.check(meta["family"], cfg)
    except fields.FieldError as e:
        raise ValueError(f"model config {path}: {e}") from None
    return cfg


# Fields that say which model a config is (and the project's own block, ``_slapo``): not
# overridable, since the model class and family are chosen from them.
IDENTITY_FIELDS = ("model_type", "architectures", "torch_dtype", "dtype", "transformers_version")


def check_overrides(name: str, overrides: dict) -> None:
    """Raise `ValueError` naming the override and the rule it breaks when the model's config
    with ``overrides`` (config fields, e.g. ``{"num_hidden_layers": 0}``) would make no model
    or a meaningless one (:mod:`slapo_ae.zoo.fields`); `KeyError` for an unknown model. A
    key that no rule knows is left to the config class (`registry.hf_config`)."""
    cfg = load_config(name)
    family = cfg[PROJECT_KEY]["family"]
    fixed = [k for k in overrides if k.startswith("_") or k in IDENTITY_FIELDS]
    if fixed:
        raise ValueError(f"override {fixed[0]} of {name}: the model's identity ({PROJECT_KEY}, "
                         f"{', '.join(IDENTITY_FIELDS)}) is its config file's, not a field to "
                         "override; name another model instead")
    try:
        fields.check(family, fields.merged(family, cfg, overrides))
    except fields.FieldError as e:
        blamed = [k for k in overrides if fields.canonical(family, k) in e.fields]
        given = " ".join(f"{k}={json.dumps(overrides[k])}" for k in blamed[:1] or overrides)
        raise ValueError(f"override {given} of {name}: {e}") from None


def model_family(name: str) -> str:
    """The model's family: one of `FAMILIES`."""
    return load_config(name)[PROJECT_KEY]["family"]


def max_seq_len(name: str, overrides: dict | None = None) -> int | None:
    """The longest sequence the model's learned position embeddings cover (with config
    ``overrides``), or None where positions do not bound it (T5's relative buckets, LLaMA's
    rotary embeddings, WideResNet). RoBERTa counts its positions from ``pad_token_id + 1``."""
    cfg = {**load_config(name), **(overrides or {})}
    family = cfg[PROJECT_KEY]["family"]
    positions = cfg.get("max_position_embeddings")
    if family not in ("bert", "roberta", "gpt_neo", "opt") or not isinstance(positions, int):
        return None
    if family == "roberta":
        return positions - (cfg.get("pad_token_id") or 0) - 1
    return positions


def check_seq_len(name: str, seq_len: int, overrides: dict | None = None) -> None:
    """Raise `ValueError` naming the model and its limit if ``seq_len`` is longer than
    :func:`max_seq_len`: the embedding lookup would fail inside every rank."""
    limit = max_seq_len(name, overrides)
    if limit is not None and seq_len > limit:
        raise ValueError(f"SEQ_LEN {seq_len} is longer than {name}'s {limit} positions "
                         "(its config's max_position_embeddings)")


def check_dec_seq_len(name: str, dec_seq_len: int) -> None:
    """Raise `ValueError` unless ``dec_seq_len`` fits the model: T5 (an encoder-decoder) needs
    its decoder's length, the other families have no decoder input (0)."""
    if model_family(name) == "t5" and dec_seq_len < 1:
        raise ValueError(f"DEC_SEQ_LEN must be the decoder's length (>= 1) for {name}, an "
                         f"encoder-decoder; got {dec_seq_len}")
    if model_family(name) != "t5" and dec_seq_len != 0:
        raise ValueError(f"DEC_SEQ_LEN is T5's decoder length; {name} has no decoder: write 0, "
                         f"got {dec_seq_len}")


def model_meta(name: str) -> dict[str, Any]:
    """The `_slapo` block of a model's config (family, paper label); {} for an unknown or
    malformed one, so that tables and figures of foreign records still draw."""
    try:
        return dict(load_config(name)[PROJECT_KEY])
    except (KeyError, ValueError):
        return {}


def paper_label(name: str) -> str:
    """The paper's label of a model (`BERT-1B`) where its config names one, else the name."""
    return model_meta(name).get("paper_label") or name
