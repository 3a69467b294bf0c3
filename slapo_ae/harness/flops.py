"""Model FLOPs per training sample, and TFLOPS per GPU.

A multiply-add counts as 2 FLOPs. Training = 3 x forward (backward ~ 2 x forward). These are
*model* FLOPs: recomputation by activation checkpointing is not counted, so the number does
not depend on the checkpoint ratio.

Two formulas for the transformer families:

- ``"paper"`` (the reported one, comparable with the paper), decoder- or encoder-only with
  n layers, hidden h, sequence s, vocab v::

      forward = n * (4*h*s^2 + 8*s*h^2 + 16*s*h^2) + 2*s*h*v

  (attention scores and context 4hs^2, Q/K/V/output projections 8sh^2, an FFN of 4h 16sh^2,
  the vocabulary projection 2shv). It assumes FFN = 4h even when the model's differs.
- ``"actual"``: the same count with the model's real FFN size f (``4*s*h*f``, or ``6*s*h*f``
  for a gated FFN like LLaMA's), and K/V projections of width ``kv_dim`` (grouped-query).

T5 (encoder-decoder) uses :func:`t5_forward_flops`, whose ``"paper"`` form is the special case
inner = d_model, d_ff = 4 d_model (the original artifact's T5 count). WideResNet has no formula
in the paper; :func:`wideresnet_forward_flops` counts its convolutions and classifier.
"""
from __future__ import annotations

TRAIN_FACTOR = 3  # forward + backward (2 x forward)
FORMULAS = ("paper", "actual")


def transformer_forward_flops_paper(n_layers: int, hidden: int, seq_len: int, vocab: int) -> int:
    """The paper's forward FLOPs per sample: ``n*(4*h*s^2 + 8*s*h^2 + 16*s*h^2) + 2*s*h*v``."""
    n, h, s, v = n_layers, hidden, seq_len, vocab
    return n * (4 * h * s**2 + 8 * s * h**2 + 16 * s * h**2) + 2 * s * h * v


def transformer_forward_flops(n_layers: int, hidden: int, seq_len: int, vocab: int, ffn: int,
                              gated: bool = False, kv_dim: int | None = None) -> int:
    """Forward FLOPs per sample with the real FFN size ``ffn`` (f) and K/V width ``kv_dim`` (k):

    ``n * (4*h*s^2 + 4*s*h^2 + 4*s*h*k + m*s*h*f) + 2*s*h*v`` with m = 4 (two FFN matrices) or
    6 (gated: three). With k = h and f = 4h, m = 4 this is the paper's formula.
    """
    n, h, s, v, f = n_layers, hidden, seq_len, vocab, ffn
    k = h if kv_dim is None else kv_dim
    m = 6 if gated else 4
    return n * (4 * h * s**2 + 4 * s * h**2 + 4 * s * h * k + m * s * h * f) + 2 * s * h * v


def t5_forward_flops(d_model: int, inner: int, d_ff: int, enc_layers: int, dec_layers: int,
                     enc_len: int, dec_len: int, vocab: int, gated: bool = False) -> int:
    """Forward FLOPs per sample of a T5-style encoder-decoder.

    With d = d_model, a = d_kv * num_heads (inner), f = d_ff, encoder length e, decoder
    length t, m = 4 (or 6 for a gated FFN)::

        self-attention on length L:   8*L*d*a + 4*L^2*a   (Q,K,V,O projections; scores, context)
        cross-attention:              4*t*d*a + 4*e*d*a + 4*t*e*a
                                      (Q,O on the decoder side; K,V on the encoder output;
                                       scores and context, t queries over e keys)
        FFN on length L:              m*L*d*f
        encoder layer:  self(e) + FFN(e)
        decoder layer:  self(t) + cross + FFN(t)
        forward = enc_layers * encoder layer + dec_layers * decoder layer + 2*t*d*v

    (the LM head runs on the decoder only). With a = d and f = 4d the encoder layer is the
    paper's ``24*e*d^2 + 4*e^2*d``, as in the original artifact's T5 count.
    """
    d, a, f, e, t, v = d_model, inner, d_ff, enc_len, dec_len, vocab
    m = 6 if gated else 4

    def self_attn(length):
        return 8 * length * d * a + 4 * length**2 * a

    cross = 4 * t * d * a + 4 * e * d * a + 4 * t * e * a
    encoder = self_attn(e) + m * e * d * f
    decoder = self_attn(t) + cross + m * t * d * f
    return enc_layers * encoder + dec_layers * decoder + 2 * t * d * v


def _conv(h_out: int, c_in: int, c_out: int, k: int, groups: int = 1) -> int:
    """FLOPs (2 x MACs) of a k x k convolution with an h_out x h_out output."""
    return 2 * h_out * h_out * c_in * c_out * k * k // groups


def wideresnet_forward_flops(layers, width_per_group: int, image_size: int = 224,
                             num_classes: int = 1000, in_channels: int = 3, groups: int = 1,
                             base_channels: int = 64) -> int:
    """Forward FLOPs per image of a wide ResNet of bottleneck blocks (slapo_ae.zoo.wideresnet,
    torchvision's layout).

    Counted: every convolution as ``2 * H_out * W_out * C_in * C_out * k * k / groups`` and
    the classifier as ``2 * C * classes``. Not counted: batch norm, ReLU, pooling, residual
    adds (well under 1%). Layout, with b = base_channels: a 7x7 stride-2 stem to b channels,
    a 3x3 stride-2 max pool, then stage i = 0..3 of ``layers[i]`` bottlenecks with
    planes = b * 2^i: 1x1 (to width = planes * width_per_group // 64 * groups), 3x3 grouped
    (stride 2 on the first block of stages 1-3), 1x1 (to 4 * planes), and a strided 1x1
    projection shortcut where the shape changes. ``wideresnet-2.4B``: [6, 8, 46, 6], width 448.
    """
    size = (image_size + 2 * 3 - 7) // 2 + 1  # stem conv, padding 3
    flops = _conv(size, in_channels, base_channels, 7)
    size = (size + 2 * 1 - 3) // 2 + 1  # max pool 3x3 stride 2, padding 1
    c_in = base_channels
    for stage, blocks in enumerate(layers):
        planes = base_channels * 2**stage
        width = planes * width_per_group // 64 * groups
        c_out = 4 * planes
        for block in range(blocks):
            stride = 2 if (stage > 0 and block == 0) else 1
            out = (size - 1) // stride + 1  # 3x3 conv, padding 1
            flops += _conv(size, c_in, width, 1)  # 1x1 reduce
            flops += _conv(out, width, width, 3, groups)  # 3x3 (carries the stride)
            flops += _conv(out, width, c_out, 1)  # 1x1 expand
            if stride != 1 or c_in != c_out:
                flops += _conv(out, c_in, c_out, 1)  # projection shortcut
            c_in, size = c_out, out
    return flops + 2 * c_in * num_classes


def _get(cfg: dict, *keys, default=None):
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    if default is not None:
        return default
    raise KeyError(f"model config ({cfg.get('model_type')}) lacks {' / '.join(keys)}")


def forward_flops_per_sample(cfg: dict, seq_len: int, dec_seq_len: int = 0,
                             formula: str = "paper") -> int:
    """Forward FLOPs per sample from an HF-style config dict, keyed on ``model_type``."""
    if formula not in FORMULAS:
        raise ValueError(f"formula must be one of {FORMULAS}, got {formula!r}")
    kind = cfg.get("model_type")
    if kind in ("wideresnet", "wide_resnet"):
        return wideresnet_forward_flops(
            cfg["layers"], cfg["width_per_group"], cfg.get("image_size", 224),
            cfg.get("num_classes", 1000), cfg.get("in_channels", 3), cfg.get("groups", 1),
            cfg.get("base_channels", 64))
    if kind == "t5":
        d = _get(cfg, "d_model")
        enc = _get(cfg, "num_layers")
        dec = _get(cfg, "num_decoder_layers", default=enc)
        if formula == "paper":
            inner, d_ff, gated = d, 4 * d, False
        else:
            inner, d_ff = _get(cfg, "d_kv") * _get(cfg, "num_heads"), _get(cfg, "d_ff")
            gated = str(cfg.get("feed_forward_proj", "")).startswith("gated")
        if dec_seq_len < 1:
            raise ValueError("t5 needs a decoder length (DEC_SEQ_LEN > 0)")
        return t5_forward_flops(d, inner, d_ff, enc, dec, seq_len, dec_seq_len,
                                _get(cfg, "vocab_size"), gated)
    if kind in ("bert", "roberta", "gpt_neo", "opt", "llama"):
        h = _get(cfg, "hidden_size")
        n = _get(cfg, "num_layers" if kind == "gpt_neo" else "num_hidden_layers")
        v = _get(cfg, "vocab_size")
        if formula == "paper":
            return transformer_forward_flops_paper(n, h, seq_len, v)
        ffn = _get(cfg, "ffn_dim" if kind == "opt" else "intermediate_size", default=4 * h)
        kv_dim = None
        if kind == "llama":
            heads = _get(cfg, "num_attention_heads")
            kv_dim = h * _get(cfg, "num_key_value_heads", default=heads) // heads
        return transformer_forward_flops(n, h, seq_len, v, ffn, gated=kind == "llama",
                                         kv_dim=kv_dim)
    raise ValueError(f"no FLOPs formula for model_type {kind!r}")


def local_attention_excess(cfg: dict, seq_len: int) -> float:
    """The share of the ``"paper"`` forward FLOPs that GPT-Neo's local layers are charged
    beyond their window (0 for a model without local layers). Both formulas charge each
    layer's scores and context ``4*h*s^2``, as if every query attended to every key; a local
    layer's query attends to at most ``window_size`` keys, ``4*h*s*min(s, w)``. (Causal
    attention is charged in full too, as the paper's formula does for every decoder.)"""
    if cfg.get("model_type") != "gpt_neo":
        return 0.0
    kinds = [kind for pattern, repeat in cfg.get("attention_types", []) for _ in range(repeat)
             for kind in pattern]
    local = kinds.count("local")
    h, s, w = _get(cfg, "hidden_size"), seq_len, _get(cfg, "window_size")
    excess = local * 4 * h * (s * s - s * min(s, w))
    return excess / forward_flops_per_sample(cfg, seq_len, formula="paper")


def train_flops_per_sample(model_config: dict, seq_len: int, dec_seq_len: int = 0,
                           formula: str = "paper") -> int:
    """Training FLOPs per sample: ``3 * forward`` (see :func:`forward_flops_per_sample`)."""
    return TRAIN_FACTOR * forward_flops_per_sample(model_config, seq_len, dec_seq_len, formula)


def tflops_per_gpu(samples_per_s: float, flops_per_sample: float, gpus: int) -> float:
    """Per-GPU model TFLOPS: ``samples/s * FLOPs per sample / GPUs / 1e12``."""
    return samples_per_s * flops_per_sample / gpus / 1e12
