"""Models of the zoo built with random weights from their configs (`configs.py`).

Nothing here downloads anything: configs are built with `AutoConfig.for_model` and models with
`Class._from_config`, never `from_pretrained`.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import nn

from .configs import PROJECT_KEY, load_config, model_family
from .fields import ACTIVATIONS
from .wideresnet import WideResNetConfig


def model_class(name: str) -> type[nn.Module]:
    """The class a model is built with (`_slapo.hf_class`): a transformers class or a dotted
    path."""
    hf_class = load_config(name)[PROJECT_KEY]["hf_class"]
    module, _, attr = hf_class.rpartition(".")
    return getattr(importlib.import_module(module or "transformers"), attr)


def hf_config(name: str, **overrides: Any):
    """The model's config object: a transformers `PretrainedConfig` or a `WideResNetConfig`.

    `overrides` replace fields of the JSON (e.g. `hidden_dropout_prob=0.0`); a key that is
    neither in the JSON nor an attribute of the config class raises `TypeError`, so a typo is
    not silently ignored, and an activation that transformers does not know `ValueError`.
    The rules of the fields' values are `fields.py`'s, checked by `configs.check_overrides`.
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
    config = config_cls(**fields)
    activation = ACTIVATIONS.get(cfg[PROJECT_KEY]["family"])
    if activation:  # else every rank fails to build the model, after the launch
        from transformers.activations import ACT2FN

        built, given = activation
        if getattr(config, built, None) not in ACT2FN:
            raise ValueError(f"{name}: {given} {getattr(config, given, None)!r} names no "
                             f"activation transformers knows ({', '.join(sorted(ACT2FN))})")
    return config


def no_dropout(name: str) -> dict[str, float]:
    """Overrides that switch off every dropout of the model (all `*dropout*` fields and
    `layerdrop`)."""
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
    with torch.random.fork_rng(devices=fork_devices,
                               device_type=device.type if fork_devices else "cuda"):
        torch.manual_seed(seed)
        with device:
            if family == "wideresnet":
                model = _build_plain(cls, config, dtype)
            else:
                model = cls._from_config(config, dtype=dtype,
                                         attn_implementation=attn_implementation)
    return model.train()


def _build_plain(cls: type[nn.Module], config: Any, dtype: torch.dtype) -> nn.Module:
    """Instantiate a non-HF model with `dtype` as the default dtype (so init runs in it)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return cls(config)
    finally:
        torch.set_default_dtype(previous)
