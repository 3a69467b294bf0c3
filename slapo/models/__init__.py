"""Offline model zoo: HF models and a WideResNet built from JSON configs with random weights.

    from slapo.models import build_model, synthetic_batch, no_dropout
    model = build_model("bert-tiny", **no_dropout("bert-tiny"))
    loss = model(**synthetic_batch("bert-tiny", batch_size=2, seq_len=16)).loss

See `registry` (names, configs, building) and `batch` (synthetic inputs).
"""

from .batch import synthetic_batch
from .registry import (
    FAMILIES,
    build_model,
    config_dir,
    hf_config,
    list_models,
    load_config,
    model_class,
    model_family,
    no_dropout,
    num_parameters,
)
from .wideresnet import WideResNet, WideResNetConfig

__all__ = [
    "FAMILIES",
    "WideResNet",
    "WideResNetConfig",
    "build_model",
    "config_dir",
    "hf_config",
    "list_models",
    "load_config",
    "model_class",
    "model_family",
    "no_dropout",
    "num_parameters",
    "synthetic_batch",
]
