"""slapo.model_schedule.apply_schedule, upstream Slapo's entry point, on one process: it returns
the schedule of the model with its family's schedule applied, honours upstream's keys where
slapo has the feature, and names the keys it rejects."""

import copy

import pytest
import torch

import slapo
from slapo.model_schedule import apply_schedule


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0, use_cache=False, attn_pdrop=0.0,
                        resid_pdrop=0.0, embd_pdrop=0.0)
    torch.manual_seed(0)
    return GPT2LMHeadModel(config), config


def _checkpointed(model):
    return [i for i, block in enumerate(model.transformer.h)
            if getattr(block, "_slapo_checkpointed", False)]


def test_returns_the_schedule_with_the_family_schedule_applied():
    model, config = _gpt2()
    ids = torch.randint(0, 64, (2, 8))
    expected = model(input_ids=ids, labels=ids).loss
    sch = apply_schedule(model, config, ckpt_ratio=0.5, prefix="transformer",
                         checkpoint_method="head",
                         attn_op_name="cuda", delay_init=True, bcast_input=False,
                         pipeline_cuts=None, sequence_parallel=False)
    assert isinstance(sch, slapo.Schedule) and sch.mod is model
    assert _checkpointed(model) == [0]
    assert type(model.transformer.h[0].mlp.c_fc).__name__ == "Conv1DGeLU"  # kernel_opt
    built = slapo.build_module(sch)
    torch.testing.assert_close(built(input_ids=ids, labels=ids).loss, expected)


def test_a_bare_gpt2_model_is_scheduled_too():
    from transformers import GPT2Model

    _, config = _gpt2()
    model = GPT2Model(config)
    ids = torch.randint(0, 64, (2, 8))
    expected = model(input_ids=ids).last_hidden_state
    apply_schedule(model, config, ckpt_ratio=1.0)
    assert type(model.h[1].mlp.c_fc).__name__ == "Conv1DGeLU"
    assert all(getattr(block, "_slapo_checkpointed", False) for block in model.h)
    torch.testing.assert_close(model(input_ids=ids).last_hidden_state, expected)


def test_schedule_options_pass_through_and_dict_configs_work():
    model, config = _gpt2()
    apply_schedule(model, {"model_type": "gpt2"}, kernel_opt=False,
                   checkpoint_method="uniform")  # upstream's default; no layer at ratio 0
    assert type(model.transformer.h[0].mlp.c_fc).__name__ == "Conv1D"
    assert _checkpointed(model) == []


@pytest.mark.parametrize("key, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_half_precision_casts_the_model(key, dtype):
    model, config = _gpt2()
    apply_schedule(model, config, **{key: True})
    assert {p.dtype for p in model.parameters()} == {dtype}


@pytest.mark.parametrize("sch_config, error, match", [
    ({"tensor_paralel": True, "ckpt": 1}, ValueError, r"unknown .* key\(s\) ckpt, tensor_paralel"),
    ({"fp16": True, "bf16": True}, ValueError, "both fp16 and bf16"),
    ({"sequence_parallel": True}, NotImplementedError, "sequence_parallel"),
    ({"pipeline_cuts": [[1]]}, ValueError,
     r"pipeline_cuts \[\[1\]\] in the model \(2 layers\) must be increasing layer indices"),
    ({"schedule_key": "bert"}, ValueError, "schedule_key says 'bert' but the model is a "
                                           "GPT2LMHeadModel of type 'gpt2'"),
    ({"checkpoint_method": "every"}, ValueError, "unknown checkpoint_method 'every'"),
    ({"prefix": "gpt2"}, ValueError, "prefix 'gpt2' names no module of GPT2LMHeadModel"),
    ({"ckpt_ratio": 2.0}, ValueError, "ckpt_ratio"),
])
def test_bad_configs_are_refused_by_name(sch_config, error, match):
    model, config = _gpt2()
    with pytest.raises(error, match=match):
        apply_schedule(model, config, **sch_config)


def _gpt2_layers(n_layer):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=n_layer, n_head=2,
                        bos_token_id=0, eos_token_id=0, use_cache=False)
    return GPT2LMHeadModel(config), config


@pytest.mark.parametrize("ratio, method, expected", [
    (0.5, "uniform", [0, 2, 4]),  # upstream's: every int(1 / ratio)-th layer from the first
    (0.4, "uniform", [0, 2, 4]),
    (0.25, "uniform", [0, 4]),
    (0.5, "head", [0, 1, 2]),  # the first round(ratio * layers)
    (1.0, "uniform", [0, 1, 2, 3, 4, 5]),
])
def test_checkpoint_methods_choose_upstreams_layers(ratio, method, expected):
    model, config = _gpt2_layers(6)
    apply_schedule(model, config, ckpt_ratio=ratio, checkpoint_method=method)
    assert _checkpointed(model) == expected


def test_uniform_checkpoints_where_the_layers_are_known_only():
    from slapo_ae.zoo import build_model

    model = build_model("t5-tiny")
    with pytest.raises(NotImplementedError, match="'uniform'.*not supported for t5"):
        apply_schedule(model, model.config, ckpt_ratio=0.5, checkpoint_method="uniform")


@pytest.mark.parametrize("cuts", [[3], [1, 1], [-1], [2, 0], [0.5]])
def test_pipeline_cuts_must_be_layers_of_the_model(cuts):
    from slapo_ae.zoo import build_model

    model = build_model("llama-tiny")  # 2 layers: the one cut is after layer 0
    with pytest.raises(ValueError, match=r"pipeline_cuts .* in the model \(2 layers\) must be "
                                         r"increasing layer indices from 0 to 0"):
        apply_schedule(model, model.config, pipeline_cuts=cuts)
    assert model.config._attn_implementation != "slapo_sdpa"  # refused before scheduling


@pytest.mark.parametrize("cuts, match", [
    ([0, 0, 0], r"for wideresnet must be 4 lists of layer indices, one for each of layer1, "
                r"layer2, layer3, layer4 \(layers \[1, 1, 1, 1\]\)"),
    ([[0], [1], [], []], r"pipeline_cuts \[1\] in layer2 \(1 layers\) must be increasing "
                         r"layer indices from 0 to 0"),
    ([[], [], [], [0]], r"no stage can be cut in layer4 \(1 layers\)"),
    ([[], [], [], []], r"cut no stage"),
])
def test_wideresnet_pipeline_cuts_are_a_list_per_layer(cuts, match):
    from slapo_ae.zoo import build_model

    model = build_model("wideresnet-tiny")  # one block in each of layer1 .. layer4
    with pytest.raises(ValueError, match=match):
        apply_schedule(model, model.config, pipeline_cuts=cuts)


@pytest.mark.parametrize("cuts, match", [
    ([0], r"for t5 must be 2 lists of layer indices, one for each of encoder.block, "
          r"decoder.block \(layers \[2, 2\]\)"),
    ([[1], []], r"pipeline_cuts \[1\] in encoder.block \(2 layers\) must be increasing layer "
                r"indices from 0 to 0"),  # after the last block: the encoder's own cut
])
def test_t5_pipeline_cuts_are_a_list_for_the_encoder_and_one_for_the_decoder(cuts, match):
    from slapo_ae.zoo import build_model

    model = build_model("t5-tiny")
    with pytest.raises(ValueError, match=match):
        apply_schedule(model, model.config, pipeline_cuts=cuts)


@pytest.mark.parametrize("name, key, inputs, cuts", [
    ("llama-tiny", "llama", ["input_ids", "attention_mask", "position_ids"], [0]),
    ("bert-tiny", "bert", ["input_ids", "attention_mask", "token_type_ids"], [0]),
    ("opt-tiny", "opt", ["input_ids", "attention_mask"], [0]),
    ("wideresnet-tiny", "wideresnet", ["pixel_values"], [[0], [], [0], []]),
    ("t5-tiny", "t5", ["input_ids", "attention_mask", "decoder_input_ids",
                       "decoder_attention_mask"], [[0], [0]]),  # and a cut after the encoder
])
def test_pipeline_cuts_trace_the_model_and_cut_its_stages(name, key, inputs, cuts):
    from slapo.pipeline.partition import split_stages
    from slapo_ae.zoo import build_model, synthetic_batch

    model = build_model(name).eval()
    plain = copy.deepcopy(model)
    sch = apply_schedule(model, model.config, schedule_key=key, pipeline_cuts=cuts)
    stages = split_stages(sch, tied=True)  # BERT's MLM decoder shares the word embedding
    assert len(stages) == 1 + sum(len(c) if isinstance(c, list) else 1 for c in cuts) + \
        (key == "t5")
    assert [n.name for n in stages[0].graph.nodes if n.op == "placeholder"] == inputs
    batch = synthetic_batch(name, 2, 12, 8 if key == "t5" else 0, seed=0)
    if key == "wideresnet":
        values = [batch["pixel_values"]]
        kwargs = {"pixel_values": batch["pixel_values"]}
    elif key == "t5":  # the encoder's output reaches the decoder's stages field by field
        kwargs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
                  "decoder_input_ids": batch["labels"],
                  "decoder_attention_mask": torch.ones_like(batch["labels"])}
        values = list(kwargs.values())
    else:
        ids = batch["input_ids"]
        third = torch.zeros_like(ids) if key == "bert" else torch.arange(12).expand_as(ids)
        values = [ids, batch["attention_mask"], third][:len(inputs)]  # token types, positions
        kwargs = {"input_ids": ids, "attention_mask": batch["attention_mask"]}
    for stage in stages:  # stage by stage, the model's logits
        values = stage(*values)
    with torch.no_grad():
        expected = plain(**kwargs)
    torch.testing.assert_close(values[0], expected.logits, rtol=1e-5, atol=1e-5)


def test_config_must_agree_with_the_model():
    model, _ = _gpt2()
    with pytest.raises(ValueError, match="model_config says 'bert'.*of type 'gpt2'"):
        apply_schedule(model, {"model_type": "bert"})
    with pytest.raises(ValueError, match="no model_type"):
        apply_schedule(model, {})


@pytest.mark.parametrize("name", ["bert-tiny", "roberta-tiny", "gpt-neo-tiny", "opt-tiny",
                                  "llama-tiny", "t5-tiny"])
def test_a_model_scheduled_in_eval_mode_computes_as_the_plain_model(name):
    """Evaluation with a scheduled model: the modules a schedule swaps in take the model's
    mode (BERT's and RoBERTa's swapped-in dropout ran in training mode: logits 0.4 off)."""

    from slapo.model_schedule import schedule_model
    from slapo_ae.zoo import build_model, synthetic_batch

    torch.manual_seed(0)
    plain = build_model(name).eval()
    scheduled = copy.deepcopy(plain)
    schedule_model(slapo.create_schedule(scheduled), tensor_parallel=False, kernel_opt=True,
                   device="cpu")
    batch = synthetic_batch(plain.config, 2, 16, 8 if name == "t5-tiny" else 0, seed=0)
    with torch.no_grad():
        torch.testing.assert_close(scheduled(**batch).logits, plain(**batch).logits,
                                   rtol=1e-5, atol=1e-5)


def test_the_harness_pipelines_families_apply_schedule_cuts():
    """Slapo-3D cuts the layers that apply_schedule's pipeline_cuts would (the harness's
    parent decides without torch which families it can pipeline: those megatron-core's GPT
    pipelines too, a subset of apply_schedule's, which cuts every family whose layers own
    their weights)."""
    from slapo.model_schedule import FAMILIES
    from slapo.model_schedule.api import NOT_CUT, PIPELINE_INPUTS
    from slapo_ae.harness.systems.support import PIPELINE_LAYERS

    assert set(PIPELINE_LAYERS) <= set(PIPELINE_INPUTS) == set(FAMILIES) - set(NOT_CUT)


def test_upstreams_wideresnet_example_form_fuses_its_blocks_under_a_wrapper():
    """Upstream's WideResNet example: torchvision's model (module names as the zoo's) under a
    wrapper that adds the loss, scheduled by name at ``prefix="model"`` with its config dict
    and ``fuse_conv`` (upstream: each block a TorchScript trace; here each block one Inductor
    region, compiled before it is checkpointed). The plain model's loss and gradients (3e-4 of
    the largest: Inductor reorders the float sums of the BatchNorms' statistics and the
    convolutions; measured on an AVX2 CPU: 1.03e-4 with one thread, 7.8e-5 with two)."""
    from torch import nn

    from slapo import state
    from slapo_ae.zoo import build_model, synthetic_batch

    class WithLoss(nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, x, labels=None):
            return nn.functional.cross_entropy(self.model(x).logits, labels)

    torch.manual_seed(0)
    plain = WithLoss(build_model("wideresnet-tiny"))
    sch = apply_schedule(copy.deepcopy(plain), "wideresnet", prefix="model", fuse_conv=True,
                         model_config={"block_size": (128, [1, 1, 1, 1])}, ckpt_ratio=0.5)
    model, _ = slapo.build(sch, init_weights=False)
    blocks = [f"model.layer{k}.0" for k in range(1, 5)]
    assert [name for name, mod in model.named_modules() if state.is_compiled(mod)] == blocks
    assert [name for name, mod in model.named_modules()
            if getattr(mod, "_slapo_checkpointed", False)] == blocks[:2]
    batch = synthetic_batch("wideresnet-tiny", 4, 0, seed=1)
    for mod in (plain, model):
        mod(batch["pixel_values"], batch["labels"]).backward()
    for (name, expected), got in zip(plain.named_parameters(), model.parameters(), strict=True):
        scale = float(expected.grad.abs().max())
        torch.testing.assert_close(got.grad, expected.grad, rtol=0, atol=3e-4 * scale, msg=name)
    with pytest.raises(NotImplementedError, match="fuse_conv is WideResNet's; leave it off for "
                                                  "gpt2"):
        apply_schedule(*_gpt2(), fuse_conv=True)


def _albert(layers: int = 3):
    from transformers import AlbertConfig, AlbertForMaskedLM

    config = AlbertConfig(vocab_size=64, embedding_size=8, hidden_size=16,
                          num_hidden_layers=layers, num_attention_heads=2, intermediate_size=32,
                          max_position_embeddings=16, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0)
    torch.manual_seed(0)
    return AlbertForMaskedLM(config), config


def test_upstreams_albert_example_form_schedules_the_shared_layer():
    """Upstream's ALBERT example: ``apply_schedule(model, "albert", model_config=...,
    prefix="albert", ...)`` with its other keys; the scheduled model computes the plain
    model's loss and gradients, the shared layer's attention on SDPA, every call of it
    checkpointed at ratio 1."""
    model, config = _albert()
    batch = {"input_ids": torch.randint(0, 64, (2, 8)), "attention_mask": torch.ones(2, 8)}
    batch["labels"] = batch["input_ids"]
    plain = copy.deepcopy(model)
    sch = apply_schedule(model, "albert", model_config=config, prefix="albert",
                         attn_op_name="cuda", ckpt_ratio=1.0, bcast_input=True, group=None,
                         pipeline_cuts=[], delay_init=False)
    built = slapo.build_module(sch)
    layer = built.albert.encoder.albert_layer_groups[0].albert_layers[0]
    assert getattr(layer, "_slapo_checkpointed", False)
    assert built.config._attn_implementation == slapo.op.sdpa.SLAPO_ATTENTION
    for mod in (plain, built):
        mod(**batch).loss.backward()
    for (name, expected), got in zip(plain.named_parameters(), built.parameters(), strict=True):
        torch.testing.assert_close(got.grad, expected.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_a_bare_albert_model_is_scheduled_too():
    """AlbertModel, no head: 2 of its 3 calls of the shared layer checkpointed, same output."""
    from transformers import AlbertModel

    from slapo.model_schedule import common

    _, config = _albert()
    model = AlbertModel(config)
    ids = torch.randint(0, 64, (2, 8))
    expected = model(input_ids=ids).last_hidden_state
    apply_schedule(model, config, ckpt_ratio=0.5)
    calls, real = [], common.checkpoint_call
    common.checkpoint_call = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        torch.testing.assert_close(model(input_ids=ids).last_hidden_state, expected)
        model(input_ids=ids)  # the count starts again with each forward
    finally:
        common.checkpoint_call = real
    assert len(calls) == 4


def test_albert_checkpointed_calls_recompute_inside_a_checkpointed_encoder():
    """The encoder checkpointed as a whole around the first calls of its shared layer: its
    recomputation (which runs no hooks) checkpoints the same calls as its forward did (it
    failed with torch's CheckpointError before the count restarted modulo the calls)."""
    model, config = _albert()
    plain = copy.deepcopy(model)
    sch = apply_schedule(model, config, ckpt_ratio=0.5)
    sch["albert.encoder"].checkpoint()
    ids = torch.randint(0, 64, (2, 8))
    for mod in (plain, model):
        mod(input_ids=ids, labels=ids).loss.backward()
    for (name, expected), got in zip(plain.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(got.grad, expected.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("sch_config, error, match", [
    ({"pipeline_cuts": [0]}, NotImplementedError,
     "pipeline_cuts \\[0\\]: ALBERT's layers share their weights"),
    ({"ckpt_ratio": 0.5, "checkpoint_method": "uniform"}, NotImplementedError,
     "'uniform' .* not supported for albert"),
])
def test_albert_refuses_what_shared_layers_cannot_do(sch_config, error, match):
    model, config = _albert()
    with pytest.raises(error, match=match):
        apply_schedule(model, config, **sch_config)
    assert not any(getattr(m, "_slapo_checkpointed", False) for m in model.modules())
