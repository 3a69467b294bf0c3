"""A checkpoint ratio r checkpoints the first round(r x layers) layers of every family, and the
gradients stay those of the plain model (fp32, dropout off, 3 SGD steps, relative error
<= 1e-5). Layers: transformer layers; T5's encoder and decoder blocks together (encoder first);
WideResNet's bottleneck blocks. ``round`` is Python's (half to even: 2.5 -> 2)."""

import pytest
import torch
from sched_helpers import TINY, assert_equal_training, side_by_side

import slapo
from slapo.model_schedule import checkpoint_layers, schedule_model
from slapo_ae.zoo import build_model

# Layer counts of the tiny configs and the name prefix of their layers.
LAYERS = {"bert": 2, "roberta": 2, "gpt_neo": 2, "opt": 2, "t5": 4, "llama": 2, "wideresnet": 4}


def _checkpointed(model) -> list[str]:
    return [name for name, m in model.named_modules() if getattr(m, "_slapo_checkpointed", False)]


@pytest.mark.parametrize("family", list(TINY))
def test_ratio_half_keeps_gradients(family):
    reports, _, scheduled = side_by_side(TINY[family], tensor_parallel=False, kernel_opt=False,
                                         ckpt_ratio=0.5)
    assert_equal_training(reports, f"{family} ckpt 0.5")
    assert len(_checkpointed(scheduled)) == round(0.5 * LAYERS[family])


@pytest.mark.parametrize("ratio", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_ratio_counts_layers(ratio):
    for family in ("t5", "wideresnet", "bert"):
        model = build_model(TINY[family])
        sch = slapo.create_schedule(model)
        schedule_model(sch, kernel_opt=False, ckpt_ratio=ratio)
        names = _checkpointed(model)
        assert len(names) == round(ratio * LAYERS[family]), (family, ratio, names)
        if family == "bert" and ratio == 1.0:
            assert names == ["bert.encoder.layer.0", "bert.encoder.layer.1"]


def test_t5_counts_encoder_then_decoder_blocks():
    model = build_model("t5-tiny")
    schedule_model(slapo.create_schedule(model), kernel_opt=False, ckpt_ratio=0.75)
    assert _checkpointed(model) == ["encoder.block.0", "encoder.block.1", "decoder.block.0"]


def test_checkpoint_layers_returns_count_and_rejects_bad_ratio():
    model = build_model("bert-tiny")
    sch = slapo.create_schedule(model)
    assert checkpoint_layers([sch["bert.encoder.layer.0"], sch["bert.encoder.layer.1"]], 1.0) == 2
    with pytest.raises(ValueError, match="ckpt_ratio"):
        checkpoint_layers([sch["bert.encoder.layer.0"]], -0.5)
    with pytest.raises(ValueError, match="ckpt_ratio"):
        schedule_model(sch, ckpt_ratio=1.5)
    assert torch.is_grad_enabled()
