"""The offline model zoo: configs shipped as JSON, models built with random weights.

A model is named as on the HF hub (`bert-large-uncased`, `EleutherAI/gpt-neo-2.7B`) or as a
paper variant (`bert-xlarge`, `wideresnet-2.4B`); its config lives at
`<config dir>/<name>.json`. The config dir is `<repo>/configs/models`, or the folder named by
the environment variable `SLAPO_MODEL_CONFIGS`.

Each JSON holds the model's real config fields plus one project key:

    "_slapo": {"family": "bert" | "roberta" | "gpt_neo" | "opt" | "t5" | "llama" | "wideresnet",
               "hf_class": "BertForMaskedLM" (a transformers class) or "pkg.module.Class",
               "description": "...", "paper_label": "BERT-1B" (optional)}

Nothing here downloads anything: configs are built with `AutoConfig.for_model` and models with
`Class._from_config`, never `from_pretrained`.
"""

from __future__ import annotations

import difflib
import importlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .wideresnet import WideResNetConfig

FAMILIES = ("bert", "roberta", "gpt_neo", "opt", "t5", "llama", "wideresnet")
ENV_CONFIG_DIR = "SLAPO_MODEL_CONFIGS"
PROJECT_KEY = "_slapo"


def config_dir() -> Path:
    """The folder of model configs: `$SLAPO_MODEL_CONFIGS` if set, else `<repo>/configs/models`."""
    if env := os.environ.get(ENV_CONFIG_DIR):
        return Path(env)
    return Path(__file__).resolve().parents[2] / "configs" / "models"


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
    file for malformed JSON or a missing/invalid `_slapo` section.
    """
    path = _config_path(name)
    try:
        cfg = json.loads(path.read_text())
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
    return cfg


def model_family(name: str) -> str:
    """The model's family: one of `FAMILIES`."""
    return load_config(name)[PROJECT_KEY]["family"]


def model_class(name: str) -> type[nn.Module]:
    """The class a model is built with (`_slapo.hf_class`): a transformers class or a dotted path."""
    hf_class = load_config(name)[PROJECT_KEY]["hf_class"]
    module, _, attr = hf_class.rpartition(".")
    return getattr(importlib.import_module(module or "transformers"), attr)


def hf_config(name: str, **overrides: Any):
    """The model's config object: a transformers `PretrainedConfig` or a `WideResNetConfig`.

    `overrides` replace fields of the JSON (e.g. `hidden_dropout_prob=0.0`); a key that is
    neither in the JSON nor an attribute of the config class raises `TypeError`, so a typo is
    not silently ignored.
    """
    cfg = load_config(name)
    fields = {k: v for k, v in cfg.items() if k not in (PROJECT_KEY, "model_type")}
    model_type = cfg["model_type"]
    if cfg[PROJECT_KEY]["family"] == "wideresnet":
        config_cls = WideResNetConfig
    else:
        from transformers import CONFIG_MAPPING

        config_cls = CONFIG_MAPPING[model_type]
    unknown = [k for k in overrides if k not in fields]
    if unknown:
        defaults = config_cls()
        unknown = [k for k in unknown if not hasattr(defaults, k)]
    if unknown:
        raise TypeError(f"{name}: unknown config override(s) {unknown}")
    fields.update(overrides)
    return config_cls(**fields)


def no_dropout(name: str) -> dict[str, float]:
    """Overrides that switch off every dropout of the model (all `*dropout*` fields and `layerdrop`)."""
    cfg = load_config(name)
    return {k: 0.0 for k in cfg if "dropout" in k or k == "layerdrop"}


def num_parameters(model: nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once); works on the meta device."""
    return sum(p.numel() for p in model.parameters())


def build_model(
    name: str,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    attn_implementation: str | None = "eager",
    **config_overrides: Any,
) -> nn.Module:
    """Build the named model with random weights, in training mode.

    - `device`: where parameters are created, directly (no CPU copy first); `"meta"` gives a
      shape-only model, e.g. to count the parameters of a 7B model without memory.
    - `dtype`: parameter dtype (initialisation runs in it).
    - `seed`: weights are a deterministic function of (name, overrides, seed, device type,
      dtype). The caller's RNG state (CPU and the target device) is left as it was.
    - `attn_implementation`: HF attention backend ("eager", "sdpa", ...); ignored for
      WideResNet. GPT-Neo has no "sdpa" in transformers 5.x, only "eager" (and flash-attn).
    - `config_overrides`: replace config fields, see `hf_config`. For HF models `use_cache`
      defaults to False (a training zoo has no use for a KV cache).
    """
    device = torch.device(device)
    family = model_family(name)
    cls = model_class(name)
    if family != "wideresnet":
        config_overrides.setdefault("use_cache", False)
    config = hf_config(name, **config_overrides)

    if device.type in ("cpu", "meta"):
        fork_devices = []
    else:
        index = device.index
        if index is None:
            index = torch.get_device_module(device.type).current_device()
        fork_devices = [index]
    with torch.random.fork_rng(devices=fork_devices, device_type=device.type if fork_devices else "cuda"):
        torch.manual_seed(seed)
        with device:
            if family == "wideresnet":
                model = _build_plain(cls, config, dtype)
            else:
                model = cls._from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    return model.train()


def _build_plain(cls: type[nn.Module], config: Any, dtype: torch.dtype) -> nn.Module:
    """Instantiate a non-HF model with `dtype` as the default dtype (so init runs in it)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return cls(config)
    finally:
        torch.set_default_dtype(previous)
