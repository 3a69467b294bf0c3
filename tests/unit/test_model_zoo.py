"""The offline model zoo (slapo_ae.zoo): configs, building, synthetic batches."""

import json

import pytest
import torch

from slapo_ae.zoo import (
    FAMILIES,
    build_model,
    hf_config,
    list_models,
    load_config,
    model_family,
    no_dropout,
    num_parameters,
    synthetic_batch,
)

TINY = ["bert-tiny", "roberta-tiny", "gpt-neo-tiny", "opt-tiny", "t5-tiny", "llama-tiny",
        "wideresnet-tiny"]

# Real-size models and the size their name (or paper label) gives them. A meta-device build
# must land within TOLERANCE of it; bert-xlarge is the paper's "BERT-1B", which is 0.87B.
NOMINAL = {
    "bert-large-uncased": 335e6,
    "bert-xlarge": 1.0e9,
    "roberta-large": 355e6,
    "roberta-xlarge": 1.3e9,
    "EleutherAI/gpt-neo-1.3B": 1.3e9,
    "EleutherAI/gpt-neo-2.7B": 2.7e9,
    "gpt-neo-2.9B": 2.9e9,
    "gpt-neo-10B": 10e9,
    "facebook/opt-350m": 350e6,
    "facebook/opt-1.3b": 1.3e9,
    "facebook/opt-2.7b": 2.7e9,
    "t5-large": 770e6,
    "t5-3b": 3.0e9,
    "llama-1.1b": 1.1e9,
    "llama-7b": 7.0e9,
    "wideresnet-250M": 250e6,
    "wideresnet-2.4B": 2.4e9,
}
TOLERANCE = 0.06
LOOSE = {"bert-xlarge": 0.15}


def test_zoo_has_every_required_model():
    assert set(NOMINAL) | set(TINY) <= set(list_models())


@pytest.mark.parametrize("name", list_models())
def test_config_loads(name):
    cfg = load_config(name)
    assert cfg["_slapo"]["family"] in FAMILIES
    assert model_family(name) == cfg["_slapo"]["family"]
    config = hf_config(name)
    assert config.model_type == cfg["model_type"]


def test_list_models_by_family():
    assert list_models("t5") == ["t5-3b", "t5-large", "t5-tiny"]


def test_tiny_configs_fit_tensor_parallel_2():
    for name in TINY[:-1]:
        c = hf_config(name)
        heads = c.num_attention_heads  # mapped to num_heads for gpt-neo and t5
        assert heads % 2 == 0 and c.vocab_size % 4 == 0, name
        assert getattr(c, "max_position_embeddings", 512) >= 256, name
    assert hf_config("llama-tiny").num_key_value_heads == 2  # GQA kept: 4 query heads, 2 KV heads
    assert hf_config("gpt-neo-tiny").attention_layers == ["global", "local"]
    assert hf_config("gpt-neo-2.9B").attention_layers == ["global"] * 32


@pytest.mark.parametrize("name", TINY)
def test_tiny_model_trains(name):
    model = build_model(name, **no_dropout(name))
    batch = synthetic_batch(name, batch_size=2, seq_len=32, dec_seq_len=16)
    out = model(**batch)
    assert out.loss.ndim == 0 and torch.isfinite(out.loss)
    out.loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname


def test_real_size_param_counts():
    rows, bad = [], []
    for name, nominal in NOMINAL.items():
        count = num_parameters(build_model(name, device="meta"))
        err = count / nominal - 1
        rows.append(f"{name:26s} {count / 1e6:10.1f}M  nominal {nominal / 1e6:8.0f}M  {err:+.1%}")
        if abs(err) > LOOSE.get(name, TOLERANCE):
            bad.append(name)
    print("\n" + "\n".join(rows))
    assert not bad, "\n".join(rows)


def test_meta_build_allocates_nothing():
    model = build_model("llama-7b", device="meta", dtype=torch.bfloat16)
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in model.parameters())


def test_unknown_name_lists_known_names():
    with pytest.raises(KeyError) as err:
        build_model("bert-large-uncase")
    msg = str(err.value)
    assert ("Did you mean 'bert-large-uncased'" in msg and "t5-3b" in msg
            and "wideresnet-2.4B" in msg)


def test_bad_config_files_are_named(tmp_path, monkeypatch):
    monkeypatch.setenv("SLAPO_MODEL_CONFIGS", str(tmp_path))
    (tmp_path / "broken.json").write_text('{"model_type": "bert",')
    (tmp_path / "nometa.json").write_text(json.dumps({"model_type": "bert"}))
    assert list_models() == ["broken", "nometa"]
    with pytest.raises(ValueError, match="broken.json"):
        load_config("broken")
    with pytest.raises(ValueError, match="nometa.json"):
        build_model("nometa")


def test_overrides_and_no_dropout():
    c = hf_config("bert-tiny", **no_dropout("bert-tiny"), num_hidden_layers=3)
    assert c.hidden_dropout_prob == 0.0 and c.attention_probs_dropout_prob == 0.0
    assert c.num_hidden_layers == 3
    assert set(no_dropout("facebook/opt-1.3b")) == {"activation_dropout", "attention_dropout",
                                                    "dropout", "layerdrop"}
    with pytest.raises(TypeError, match="hiden_size"):
        hf_config("bert-tiny", hiden_size=64)


def test_build_is_deterministic_and_leaves_rng_alone():
    state = torch.random.get_rng_state()
    a = build_model("llama-tiny", seed=3).state_dict()
    b = build_model("llama-tiny", seed=3).state_dict()
    c = build_model("llama-tiny", seed=4).state_dict()
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


@pytest.mark.parametrize("name", ["opt-tiny", "wideresnet-tiny"])
def test_dtype_is_honoured(name):
    model = build_model(name, dtype=torch.bfloat16, **no_dropout(name))
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    loss = model(**synthetic_batch(name, 2, 16, dtype=torch.bfloat16)).loss
    assert loss.dtype in (torch.bfloat16, torch.float32) and torch.isfinite(loss)


def test_attention_implementation():
    llama = build_model("llama-tiny", attn_implementation="sdpa")
    assert llama.config._attn_implementation == "sdpa"
    assert build_model("gpt-neo-tiny").config._attn_implementation == "eager"
    assert build_model("gpt-neo-tiny").config.use_cache is False


def test_synthetic_batch():
    b = synthetic_batch("gpt-neo-tiny", batch_size=3, seq_len=20, seed=7)
    assert set(b) == {"input_ids", "attention_mask", "labels"}
    assert b["input_ids"].shape == (3, 20) and b["input_ids"].dtype == torch.long
    assert 0 <= b["input_ids"].min() and b["input_ids"].max() < 1024
    assert torch.equal(b["labels"], b["input_ids"]) and bool(b["attention_mask"].all())
    again = synthetic_batch(load_config("gpt-neo-tiny"), batch_size=3, seq_len=20, seed=7)
    assert torch.equal(again["input_ids"], b["input_ids"])
    assert not torch.equal(synthetic_batch("gpt-neo-tiny", 3, 20, seed=8)["input_ids"],
                           b["input_ids"])

    t5 = synthetic_batch(hf_config("t5-tiny"), batch_size=2, seq_len=12, dec_seq_len=5)
    assert t5["input_ids"].shape == (2, 12) and t5["labels"].shape == (2, 5)
    with pytest.raises(ValueError, match="dec_seq_len"):
        synthetic_batch("t5-tiny", 2, 12)

    img = synthetic_batch("wideresnet-tiny", batch_size=4, seq_len=1)
    assert img["pixel_values"].shape == (4, 3, 32, 32) and img["labels"].shape == (4,)
    assert int(img["labels"].max()) < 100


def test_wideresnet_structure():
    model = build_model("wideresnet-tiny")
    block = model.layer2[0]
    # width = planes * width_per_group / 64 = 32 * 2; stride in the 3x3 conv; expansion 4
    assert block.conv2.stride == (2, 2) and block.conv2.in_channels == 64
    assert block.conv3.out_channels == 128 and block.downsample is not None
    out = model(synthetic_batch("wideresnet-tiny", 2, 1)["pixel_values"])
    assert out.loss is None and out.logits.shape == (2, 100)
    assert torch.isfinite(out.logits).all()


def test_wideresnet_initialises_one_module_at_a_time_as_slapo_build_asks():
    """slapo.build(sch) (init_weights=True, upstream's default) calls the model's
    _init_weights(module) for each module, as for a transformers model; WideResNet's took no
    module (a TypeError). Every parameter is written again (here from zeros): convolutions by
    Kaiming's rule, batch norms ones and zeros, the classifier as torch's Linear."""
    import slapo

    model = build_model("wideresnet-tiny")
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    built = slapo.build(slapo.create_schedule(model))[0]
    for name, param in built.named_parameters():
        if name.endswith("bias") and not name.startswith("fc."):  # batch norms'
            assert not param.any(), name
        elif ".bn" in name or name.startswith("bn") or "downsample.1" in name:
            assert torch.equal(param, torch.ones_like(param)), name
        else:  # convolutions and the classifier
            assert param.std() > 0, name
    fan_out = built.conv1.out_channels * built.conv1.kernel_size[0] ** 2
    assert built.conv1.weight.std().item() == pytest.approx((2 / fan_out) ** 0.5, rel=0.2)


def test_a_malformed_model_config_is_named(tmp_path, monkeypatch):
    from slapo_ae.zoo.configs import load_config

    monkeypatch.setenv("SLAPO_MODEL_CONFIGS", str(tmp_path))
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "bare.json").write_text('{"model_type": "bert"}')
    with pytest.raises(ValueError, match=r"malformed model config .*broken\.json"):
        load_config("broken")
    with pytest.raises(ValueError, match=r"bare\.json needs a '_slapo' object"):
        load_config("bare")
