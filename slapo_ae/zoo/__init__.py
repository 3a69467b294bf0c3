"""Offline model zoo: HF models and a WideResNet built from JSON configs with random weights.

    from slapo_ae.zoo import build_model, synthetic_batch, no_dropout
    model = build_model("bert-tiny", **no_dropout("bert-tiny"))
    loss = model(**synthetic_batch("bert-tiny", batch_size=2, seq_len=16)).loss

`configs` reads the JSON configs (names, families; no torch), `registry` builds models,
`batch` makes synthetic inputs, `wideresnet` defines the one model that is not in transformers.
The names below are loaded on first use, so that reading configs (the planner, the analysis)
never imports torch.
"""

import importlib

_WHERE = {
    "FAMILIES": "configs", "config_dir": "configs", "list_models": "configs",
    "load_config": "configs", "model_family": "configs", "paper_label": "configs",
    "build_model": "registry", "hf_config": "registry", "model_class": "registry",
    "no_dropout": "registry", "num_parameters": "registry",
    "synthetic_batch": "batch", "WideResNet": "wideresnet", "WideResNetConfig": "wideresnet",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
