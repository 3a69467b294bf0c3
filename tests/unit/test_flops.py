"""Model FLOPs formulas (slapo_ae.harness.flops) against hand-computed values."""
import pytest

from slapo_ae.harness.flops import (
    forward_flops_per_sample,
    local_attention_excess,
    t5_forward_flops,
    tflops_per_gpu,
    train_flops_per_sample,
    transformer_forward_flops,
    transformer_forward_flops_paper,
    wideresnet_forward_flops,
)

BERT_LARGE = {"model_type": "bert", "hidden_size": 1024, "num_hidden_layers": 24,
              "intermediate_size": 4096, "vocab_size": 30522}


def test_bert_large_by_hand():
    # n=24 layers, h=1024, s=512, v=30522
    #   4*h*s^2  = 4 * 1024 * 512^2   =  1_073_741_824
    #   8*s*h^2  = 8 * 512 * 1024^2   =  4_294_967_296
    #   16*s*h^2 = 16 * 512 * 1024^2  =  8_589_934_592
    #   one layer                     = 13_958_643_712;  x 24 = 335_007_449_088
    #   2*s*h*v  = 2 * 512 * 1024 * 30522 = 32_004_636_672
    #   forward  = 367_012_085_760;  training = 3 x forward = 1_101_036_257_280
    assert transformer_forward_flops_paper(24, 1024, 512, 30522) == 367_012_085_760
    assert train_flops_per_sample(BERT_LARGE, 512) == 1_101_036_257_280
    # bert-large's FFN is 4h, so the "actual" count is the same
    assert train_flops_per_sample(BERT_LARGE, 512, formula="actual") == 1_101_036_257_280
    # 10 samples/s on 2 GPUs: 10 * 1.101e12 / 2 / 1e12 TFLOPS per GPU
    assert tflops_per_gpu(10, 1_101_036_257_280, 2) == pytest.approx(5.50518128640)


def test_reference_anchor_gpt_neo_1p3b_on_h200():
    # the H200 anchors (analysis/gpu_check.py): 49.6 samples/s of gpt-neo-1.3B (seq 1024) is
    # about 430 model TFLOPS
    cfg = {"model_type": "gpt_neo", "hidden_size": 2048, "num_layers": 24, "vocab_size": 50257}
    assert tflops_per_gpu(49.6, train_flops_per_sample(cfg, 1024), 1) == pytest.approx(430, abs=1)


def test_actual_formula_uses_the_real_ffn():
    # bert-xlarge: h=2048 but intermediate 4096 = 2h, so each layer's FFN is 4*s*h*f, not 16*s*h^2
    n, h, s, v, f = 24, 2048, 512, 30522, 4096
    cfg = {"model_type": "bert", "hidden_size": h, "num_hidden_layers": n,
           "intermediate_size": f, "vocab_size": v}
    paper = n * (4 * h * s**2 + 8 * s * h**2 + 16 * s * h**2) + 2 * s * h * v
    actual = n * (4 * h * s**2 + 8 * s * h**2 + 4 * s * h * f) + 2 * s * h * v
    assert forward_flops_per_sample(cfg, s) == paper
    assert forward_flops_per_sample(cfg, s, formula="actual") == actual < paper
    assert transformer_forward_flops(n, h, s, v, ffn=4 * h) == paper


def test_opt_and_llama_fields():
    opt = {"model_type": "opt", "hidden_size": 8, "num_hidden_layers": 2, "ffn_dim": 16,
           "vocab_size": 10}
    # per layer 4*8*9 + 8*3*64 + 4*3*8*16 = 288 + 1536 + 1536; head 2*3*8*10 = 480
    assert forward_flops_per_sample(opt, 3, formula="actual") == 2 * (288 + 1536 + 1536) + 480
    llama = {"model_type": "llama", "hidden_size": 8, "num_hidden_layers": 1,
             "intermediate_size": 16, "vocab_size": 10, "num_attention_heads": 4,
             "num_key_value_heads": 1}
    # kv width 8*1/4 = 2; gated FFN: three matrices
    # 4*h*s^2 + 4*s*h^2 + 4*s*h*k + 6*s*h*f = 288 + 768 + 192 + 2304; head 480
    assert forward_flops_per_sample(llama, 3, formula="actual") == 288 + 768 + 192 + 2304 + 480
    assert forward_flops_per_sample(llama, 3) == transformer_forward_flops_paper(1, 8, 3, 10)


def test_t5_by_hand():
    # d=2, inner a=4, f=8, encoder e=3, decoder t=2, one layer each, v=5
    #   encoder: self(3) = 8*3*2*4 + 4*9*4 = 192 + 144 = 336; FFN 4*3*2*8 = 192  -> 528
    #   decoder: self(2) = 8*2*2*4 + 4*4*4 = 128 + 64 = 192
    #            cross   = 4*2*2*4 + 4*3*2*4 + 4*2*3*4 = 64 + 96 + 96 = 256
    #            FFN     = 4*2*2*8 = 128                                       -> 576
    #   LM head on the decoder: 2*2*2*5 = 40;  total 1144
    assert t5_forward_flops(2, 4, 8, 1, 1, 3, 2, 5) == 1144
    # gated FFN: 6 instead of 4 -> FFNs 288 + 192
    assert t5_forward_flops(2, 4, 8, 1, 1, 3, 2, 5, gated=True) == 1144 + 96 + 64


T5_3B = {"model_type": "t5", "d_model": 1024, "d_kv": 128, "num_heads": 32, "d_ff": 16384,
         "num_layers": 24, "num_decoder_layers": 24, "vocab_size": 32128,
         "feed_forward_proj": "relu"}


def test_t5_paper_form_is_the_artifacts_count():
    # The original artifact's T5 count in expanded form (h = d_model, FFN 4h, inner h):
    # 3 * [l_e*(24*e*h^2 + 4*e^2*h)
    #      + l_d*(24*t*h^2 + 4*t^2*h + 4*t*h^2 + 4*e*h^2 + 4*t*e*h) + 2*t*h*v]
    h, e, t, v, le, ld = 1024, 1024, 512, 32128, 24, 24
    expected = 3 * (le * (24 * e * h**2 + 4 * e**2 * h)
                    + ld * (24 * t * h**2 + 4 * t**2 * h + 4 * t * h**2 + 4 * e * h**2
                            + 4 * t * e * h) + 2 * t * h * v)
    assert train_flops_per_sample(T5_3B, 1024, 512) == expected
    # t5-3b's real inner width (4096) and FFN (16384 = 16h) make the actual count larger
    actual = train_flops_per_sample(T5_3B, 1024, 512, formula="actual")
    assert actual == 3 * t5_forward_flops(1024, 4096, 16384, 24, 24, 1024, 512, 32128)
    assert actual > 2.5 * expected


def test_wideresnet_stem_and_classifier_by_hand():
    # no blocks: 7x7 stem on 32x32 -> 16x16 x 64 channels, then the classifier on 64 channels
    #   stem: 2 * 16*16 * 3 * 64 * 49 = 4_816_896;  classifier: 2 * 64 * 10 = 1_280
    assert wideresnet_forward_flops([0, 0, 0, 0], 64, image_size=32, num_classes=10) == 4_818_176


def test_wideresnet_matches_published_resnet_macs():
    # torchvision's published MACs at 224x224: resnet50 4.09 G, wide_resnet50_2 11.40 G
    assert wideresnet_forward_flops([3, 4, 6, 3], 64) / 2 == pytest.approx(4.09e9, rel=2e-3)
    assert wideresnet_forward_flops([3, 4, 6, 3], 128) / 2 == pytest.approx(11.40e9, rel=2e-3)
    cfg = {"model_type": "wideresnet", "layers": [6, 8, 46, 6], "width_per_group": 448}
    assert train_flops_per_sample(cfg, 1) == 3 * wideresnet_forward_flops([6, 8, 46, 6], 448)


@pytest.mark.parametrize("layers, width, groups, size", [([1, 2, 1, 1], 32, 1, 64),
                                                      ([1, 1, 1, 1], 4, 8, 32)])
def test_wideresnet_matches_the_model_zoo(layers, width, groups, size):
    """The count equals torch's FlopCounterMode on the project's WideResNet (convs + fc)."""
    torch = pytest.importorskip("torch")
    wrn = pytest.importorskip("slapo_ae.zoo.wideresnet")
    from torch.utils.flop_counter import FlopCounterMode

    cfg = wrn.WideResNetConfig(layers=layers, width_per_group=width, groups=groups,
                               num_classes=7, image_size=size)
    model = wrn.WideResNet(cfg).eval()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.zeros(1, 3, size, size))
    assert counter.get_total_flops() == forward_flops_per_sample(cfg.to_dict(), 1)


def test_dispatcher_errors():
    with pytest.raises(ValueError, match="model_type 'vit'"):
        train_flops_per_sample({"model_type": "vit"}, 16)
    with pytest.raises(ValueError, match="DEC_SEQ_LEN"):
        train_flops_per_sample(T5_3B, 1024)
    with pytest.raises(ValueError, match="formula"):
        train_flops_per_sample(BERT_LARGE, 512, formula="hardware")
    with pytest.raises(KeyError, match="hidden_size"):
        train_flops_per_sample({"model_type": "bert"}, 512)


def test_what_the_formula_charges_gpt_neos_local_layers_beyond_their_window():
    gpt_neo = {"model_type": "gpt_neo", "hidden_size": 2048, "num_layers": 24,
               "vocab_size": 50257, "attention_types": [[["global", "local"], 12]],
               "window_size": 256}
    # 12 local layers x 4*h*(s^2 - s*w) = 12 * 4 * 2048 * (1024^2 - 1024*256) = 77_309_411_328
    #   of the paper's forward: 24 * (4*2048*1024^2 + 24*1024*2048^2) + 2*1024*2048*50257
    #   = 24 * 111_669_149_696 + 210_793_136_128 = 2_890_852_728_832
    assert forward_flops_per_sample(gpt_neo, 1024) == 2_890_852_728_832
    assert local_attention_excess(gpt_neo, 1024) == pytest.approx(
        77_309_411_328 / 2_890_852_728_832)
    assert local_attention_excess(gpt_neo, 256) == 0.0  # a window as long as the sequence
    assert local_attention_excess(BERT_LARGE, 512) == 0.0
