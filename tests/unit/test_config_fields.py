"""The rules of model-config fields (slapo_ae/zoo/fields.py): the zoo's configs meet them, an
override or a user's config that breaks one is refused before anything runs, naming the field
and the rule, and the rules are checked without torch."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from slapo_ae.case import Case, CaseError
from slapo_ae.cfg import CfgError, parse_cfg_text
from slapo_ae.zoo import fields
from slapo_ae.zoo.configs import check_overrides, list_models, load_config

REPO = Path(__file__).resolve().parents[2]


def test_every_model_of_the_zoo_meets_its_rules():
    for name in list_models():
        cfg = load_config(name)  # load_config checks them; once more, explicitly
        fields.check(cfg["_slapo"]["family"], cfg)


def test_each_rule_names_a_field_its_family_has_and_every_alias_is_known():
    """A misspelt rule would check nothing: every field a rule names is one of the family's
    config class or of its JSON configs, and transformers' aliases are all in ALIASES (an
    alias missing there would pass an override under the rule's nose)."""
    from transformers import CONFIG_MAPPING

    from slapo_ae.zoo.wideresnet import WideResNetConfig

    for family, rules in fields.RULES.items():
        known = set()
        for name in list_models(family):
            known |= set(load_config(name))
        if family == "wideresnet":
            known |= {f.name for f in dataclasses.fields(WideResNetConfig)}
        else:
            cls = CONFIG_MAPPING[family]
            known |= set(vars(cls())) | set(cls.attribute_map.values())
            assert cls.attribute_map == fields.ALIASES.get(family, {}), family
        assert set(rules) <= known, (family, set(rules) - known)
        assert family in fields.HEADS or family in ("t5", "wideresnet")


@pytest.mark.parametrize("name, overrides", [
    ("bert-tiny", {"num_hidden_layers": 1, "hidden_dropout_prob": 0, "classifier_dropout": 1}),
    ("bert-tiny", {"classifier_dropout": None, "hidden_size": 64, "intermediate_size": 64}),
    ("t5-tiny", {"num_hidden_layers": 1, "num_decoder_layers": None, "d_kv": 7}),
    ("llama-tiny", {"head_dim": 48, "hidden_size": 96, "num_attention_heads": 4}),
    ("gpt-neo-tiny", {"num_layers": 4, "attention_types": [[["global", "local"], 2]]}),
    ("opt-tiny", {"layerdrop": 1.0, "pad_token_id": 1023}),
    ("wideresnet-tiny", {"layers": [1, 2], "base_channels": 8, "width_per_group": 8}),
])
def test_overrides_within_the_rules_pass(name, overrides):
    check_overrides(name, overrides)


@pytest.mark.parametrize("name, overrides, message", [
    ("bert-tiny", {"num_hidden_layers": True},
     "override num_hidden_layers=true of bert-tiny: num_hidden_layers must be a positive "
     "integer (a size or count), got True"),
    ("bert-tiny", {"hidden_size": None},
     "override hidden_size=null of bert-tiny: hidden_size must be a positive integer"),
    ("bert-tiny", {"layer_norm_eps": 0}, "layer_norm_eps must be a finite number above 0"),
    ("bert-tiny", {"initializer_range": -0.1}, "initializer_range must be a finite number of "
                                               "at least 0, got -0.1"),
    ("bert-tiny", {"attention_probs_dropout_prob": float("nan")}, "must be a probability"),
    ("roberta-tiny", {"vocab_size": 1}, "override vocab_size=1 of roberta-tiny: pad_token_id "
                                        "1 is not below vocab_size 1 (the embedding has no row "
                                        "for it)"),
    ("roberta-tiny", {"max_position_embeddings": 2}, "max_position_embeddings 2 leaves no "
                                                     "position: RoBERTa counts positions from "
                                                     "pad_token_id + 1 = 2"),
    ("t5-tiny", {"decoder_start_token_id": 1024}, "decoder_start_token_id 1024 is not below "
                                                  "vocab_size 1024"),
    ("t5-tiny", {"num_attention_heads": 0}, "override num_attention_heads=0 of t5-tiny: "
                                            "num_heads must be a positive integer"),
    ("gpt-neo-tiny", {"attention_types": [[["global", "sparse"], 1]]},
     'attention_types must be a list of [[kinds...], repeats] with kinds "global" or "local"'),
    ("gpt-neo-tiny", {"num_heads": 3}, "num_heads 3 does not divide hidden_size 128"),
    ("llama-tiny", {"num_attention_heads": 3}, "num_attention_heads 3 does not divide "
                                               "hidden_size 128"),
    ("opt-tiny", {"ffn_dim": 0}, "ffn_dim must be a positive integer"),
    ("opt-tiny", {"some_dropout": 3}, "some_dropout must be a probability in [0, 1], got 3"),
    ("wideresnet-tiny", {"layers": []}, "layers must be a non-empty list of positive integers"),
    ("wideresnet-tiny", {"base_channels": 1, "width_per_group": 32},
     "base_channels 1 x width_per_group 32 / 64 gives the first stage's blocks no width"),
])
def test_overrides_that_break_a_rule_are_named(name, overrides, message):
    with pytest.raises(ValueError) as err:
        check_overrides(name, overrides)
    assert message in str(err.value), str(err.value)


def test_a_case_refuses_its_overrides_whatever_encoding_brought_it():
    case = parse_cfg_text("eager bert-tiny 1 16 0 2 0", "x.cfg")[0].for_run(2, 1, "fp32", "cpu")
    data = json.loads(case.to_json())
    with pytest.raises(CaseError, match="override num_hidden_layers=-1 of bert-tiny: "
                                        "num_hidden_layers must be a positive integer"):
        Case.from_json(json.dumps({**data, "overrides": {"num_hidden_layers": -1}}))
    with pytest.raises(CaseError, match="num_hidden_layers must be a positive integer"):
        dataclasses.replace(case, overrides={"num_hidden_layers": 0})
    with pytest.raises(CaseError, match="unknown model 'no-such-model'"):
        dataclasses.replace(case, model="no-such-model", overrides={"num_hidden_layers": 2})
    fine = dataclasses.replace(case, overrides={"num_hidden_layers": 3})
    assert Case.from_json(fine.to_json()) == fine


def test_a_users_model_config_that_breaks_a_rule_is_named_by_file(tmp_path, monkeypatch):
    monkeypatch.setenv("SLAPO_MODEL_CONFIGS", str(tmp_path))
    cfg = json.loads((REPO / "configs" / "models" / "bert-tiny.json").read_text())
    (tmp_path / "hollow-bert.json").write_text(json.dumps({**cfg, "num_hidden_layers": 0}))
    path = tmp_path / "hollow-bert.json"
    with pytest.raises(ValueError) as err:
        load_config("hollow-bert")
    assert str(err.value) == (f"model config {path}: num_hidden_layers must be a positive "
                              "integer (a size or count), got 0")
    with pytest.raises(CfgError) as err:
        parse_cfg_text("eager hollow-bert 1 16 0 2 0", "mine.cfg", known_models=["hollow-bert"])
    assert err.value.errors == [f"mine.cfg:1: model config {path}: num_hidden_layers must be a "
                                "positive integer (a size or count), got 0"]


def test_the_rules_are_checked_without_torch():
    script = ("import sys\n"
              "from slapo_ae.case import Case\n"
              "from slapo_ae.cfg import parse_cfg_text\n"
              "case = parse_cfg_text('eager bert-tiny 1 16 0 2 0', 'x.cfg')[0]\n"
              "try:\n"
              "    Case(**{**case.__dict__, 'overrides': {'num_hidden_layers': 0}})\n"
              "except ValueError as err:\n"
              "    print(type(err).__name__, 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.stdout.split() == ["CaseError", "False"], out.stderr
