"""Tiny HF blocks of each family of the paper, with example inputs, for the static-graph tests.

Every config has dropout 0 (so that outputs compare exactly) and eager attention (so that the
attention core is visible as ops); hidden size 32, 4 heads.
"""

from __future__ import annotations

import torch
from torch import nn

H, HEADS, FFN, VOCAB = 32, 4, 64, 128

TOL = 1e-5             # relative error of loss, output and each gradient
STEPS = 3
EXAMPLE = (2, 8)        # batch, sequence length of the example inputs
RUN = (3, 6)            # ... and of the training batches


def assert_trains_alike(reports, what):
    assert len(reports) == STEPS
    for step, r in enumerate(reports):
        assert r.loss_error <= TOL, f"{what} step {step}: loss {r.loss_scheduled} vs {r.loss_plain}"
        assert r.output_error <= TOL, f"{what} step {step}: output error {r.output_error:.1e}"
        name, err = r.max_grad_error
        assert err <= TOL, f"{what} step {step}: gradient of '{name}' off by {err:.1e}"


def square_loss(model, batch):
    """Squared distance to a fixed non-constant target (a plain ``(out ** 2).mean()`` has a
    vanishing gradient after a LayerNorm)."""
    out = first_tensor(model(**batch))
    target = torch.cos(torch.arange(out.numel(), dtype=out.dtype)).view_as(out)
    return ((out - target) ** 2).mean(), out


def bert_config(**kw):
    from transformers import BertConfig
    return BertConfig(**{**dict(hidden_size=H, num_hidden_layers=2, num_attention_heads=HEADS,
                                intermediate_size=FFN, vocab_size=VOCAB, hidden_dropout_prob=0.0,
                                attention_probs_dropout_prob=0.0, attn_implementation="eager"),
                         **kw})


def roberta_config(**kw):
    from transformers import RobertaConfig
    return RobertaConfig(**{**dict(hidden_size=H, num_hidden_layers=2, num_attention_heads=HEADS,
                                   intermediate_size=FFN, vocab_size=VOCAB,
                                   hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                   attn_implementation="eager"), **kw})


def gpt_neo_config(**kw):
    from transformers import GPTNeoConfig
    return GPTNeoConfig(**{**dict(hidden_size=H, num_layers=2, num_heads=HEADS,
                                  intermediate_size=FFN, vocab_size=VOCAB, window_size=4,
                                  attention_types=[[["global", "local"], 1]], embed_dropout=0.0,
                                  attention_dropout=0.0, resid_dropout=0.0, bos_token_id=0,
                                  eos_token_id=0, attn_implementation="eager"), **kw})


def opt_config(**kw):
    from transformers import OPTConfig
    return OPTConfig(**{**dict(hidden_size=H, num_hidden_layers=2, num_attention_heads=HEADS,
                               ffn_dim=FFN, vocab_size=VOCAB, word_embed_proj_dim=H, dropout=0.0,
                               attention_dropout=0.0, bos_token_id=0, eos_token_id=0,
                               pad_token_id=1, attn_implementation="eager"), **kw})


def t5_config(**kw):
    from transformers import T5Config
    return T5Config(**{**dict(d_model=H, d_kv=H // HEADS, d_ff=FFN, num_layers=2, num_heads=HEADS,
                              vocab_size=VOCAB, dropout_rate=0.0, attn_implementation="eager"),
                       **kw})


def llama_config(**kw):
    from transformers import LlamaConfig
    return LlamaConfig(**{**dict(hidden_size=H, num_hidden_layers=2, num_attention_heads=HEADS,
                                 num_key_value_heads=2, intermediate_size=FFN, vocab_size=VOCAB,
                                 attn_implementation="eager"), **kw})


def hidden(batch: int, seq: int, seed: int, width: int = H) -> torch.Tensor:
    return torch.randn(batch, seq, width, generator=torch.Generator().manual_seed(seed))


def additive_mask(batch: int, seq: int, seed: int) -> torch.Tensor:
    """A (batch, 1, seq, seq) additive mask hiding a few random keys."""
    gen = torch.Generator().manual_seed(seed)
    hide = torch.rand(batch, 1, 1, seq, generator=gen) < 0.2
    hide[..., 0] = False
    return torch.zeros(batch, 1, seq, seq).masked_fill(hide, torch.finfo(torch.float32).min)


def llama_rotary(batch: int, seq: int):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    rot = LlamaRotaryEmbedding(llama_config())
    pos = torch.arange(seq)[None].expand(batch, seq)
    return rot(torch.zeros(batch, seq, H), pos)


def _inputs(kind: str):
    """``inputs(batch, seq, seed) -> dict`` for each input signature of the blocks."""
    def make(batch, seq, seed):
        x = hidden(batch, seq, seed)
        if kind == "x":
            return {"hidden_states": x}
        if kind == "x_mask":
            return {"hidden_states": x, "attention_mask": additive_mask(batch, seq, seed)}
        if kind == "t5_attn":
            return {"hidden_states": x, "mask": additive_mask(batch, seq, seed)}
        if kind == "bert_output":
            return {"hidden_states": hidden(batch, seq, seed + 7, FFN), "input_tensor": x}
        if kind == "llama_attn":
            return {"hidden_states": x, "position_embeddings": llama_rotary(batch, seq),
                    "attention_mask": additive_mask(batch, seq, seed)}
        if kind == "llama_mlp":
            return {"x": x}
        raise KeyError(kind)
    return make


def blocks() -> dict:
    """name -> (factory, inputs(batch, seq, seed) -> dict)."""
    from transformers.models.bert import modeling_bert as bert
    from transformers.models.gpt_neo import modeling_gpt_neo as neo
    from transformers.models.llama import modeling_llama as llama
    from transformers.models.opt import modeling_opt as opt
    from transformers.models.roberta import modeling_roberta as roberta
    from transformers.models.t5 import modeling_t5 as t5

    return {
        "bert.BertSelfAttention": (lambda: bert.BertSelfAttention(bert_config()),
                                   _inputs("x_mask")),
        "bert.BertIntermediate": (lambda: bert.BertIntermediate(bert_config()), _inputs("x")),
        "bert.BertOutput": (lambda: bert.BertOutput(bert_config()), _inputs("bert_output")),
        "bert.BertLayer": (lambda: bert.BertLayer(bert_config()), _inputs("x_mask")),
        "roberta.RobertaLayer": (lambda: roberta.RobertaLayer(roberta_config()),
                                 _inputs("x_mask")),
        "gpt_neo.GPTNeoSelfAttention(local)": (
            lambda: neo.GPTNeoSelfAttention(gpt_neo_config(), "local"), _inputs("x_mask")),
        "gpt_neo.GPTNeoMLP": (lambda: neo.GPTNeoMLP(FFN, gpt_neo_config()), _inputs("x")),
        "gpt_neo.GPTNeoBlock": (lambda: neo.GPTNeoBlock(gpt_neo_config(), 0), _inputs("x_mask")),
        "opt.OPTAttention": (lambda: opt.OPTAttention(opt_config(), layer_idx=0),
                             _inputs("x_mask")),
        "opt.OPTDecoderLayer": (lambda: opt.OPTDecoderLayer(opt_config(), 0), _inputs("x_mask")),
        "t5.T5Attention": (lambda: t5.T5Attention(t5_config(), has_relative_attention_bias=True),
                           _inputs("t5_attn")),
        "t5.T5LayerFF": (lambda: t5.T5LayerFF(t5_config()), _inputs("x")),
        "llama.LlamaAttention": (lambda: llama.LlamaAttention(llama_config(), 0),
                                 _inputs("llama_attn")),
        "llama.LlamaMLP": (lambda: llama.LlamaMLP(llama_config()), _inputs("llama_mlp")),
        "llama.LlamaDecoderLayer": (lambda: llama.LlamaDecoderLayer(llama_config(), 0),
                                    _inputs("llama_attn")),
    }


def first_tensor(out):
    """The main output of a block (HF blocks return a tensor or a tuple led by it)."""
    return out if isinstance(out, torch.Tensor) else out[0]


# --- a model for pipeline parallelism --------------------------------------------------
def pipeline_model(layers: int = 4, tie: bool = False):
    """A 4-layer BERT MLM (untied head by default: a stage owns each parameter)."""
    from transformers import BertForMaskedLM
    torch.manual_seed(0)
    return BertForMaskedLM(bert_config(num_hidden_layers=layers, tie_word_embeddings=tie))


def pipeline_batch(step: int, batch: int = 4, seq: int = 8):
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1, seq - 2:] = 0
    labels = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    return ids, mask, labels


def pipeline_loss(output, labels):
    logits = output[0] if isinstance(output, (tuple, list)) else output
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             labels.reshape(-1))


def pipeline_schedule(model, cuts=("bert.encoder.layer.1",)):
    """Trace the whole model (hierarchy kept) and cut it; returns the schedule."""
    import slapo
    ids, mask, _ = pipeline_batch(99, batch=2, seq=6)
    sch = slapo.create_schedule(model)
    sch.trace(example_inputs={"input_ids": ids, "attention_mask": mask},
              concrete_args={"use_cache": False, "return_dict": False})
    for path in cuts:
        sch[path].cut_pipeline_stage()
    return sch


class Together(nn.Module):
    """q, k and v in one call: what a fused QKV kernel would compute (horizontal fusion)."""

    def __init__(self, q, k, v):
        super().__init__()
        self.q, self.k, self.v = q, k, v

    def forward(self, x):
        return self.q(x), self.k(x), self.v(x)


class Chain(nn.Module):
    """Three Linear layers in a row, to cut into pipeline stages in the misuse tests."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.c(self.b(self.a(x)))
