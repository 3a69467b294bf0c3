"""``megatron``: megatron-core's own models with tensor parallelism = rank count (the paper's
Megatron-LM column).

The zoo model's HF config is mapped onto a megatron ``TransformerConfig`` and megatron-core's
model of the family, with its local layer spec (no Transformer Engine):

| family  | megatron-core model | mapping notes                                               |
|---------|---------------------|-------------------------------------------------------------|
| bert    | BertModel           | Megatron's BERT (pre-LayerNorm), no binary head, tied head  |
| gpt_neo | GPTModel            | learned positions, tanh GeLU; **global attention in every   |
|         |                     | layer** (GPT-Neo's local attention has no megatron form)    |
| llama   | GPTModel            | RMSNorm, SwiGLU, RoPE, grouped-query attention, no biases   |
| t5      | T5Model             | RMSNorm, no biases; learned absolute positions (relative    |
|         |                     | buckets need Transformer Engine's attention, as notes say)  |

RoBERTa, OPT and WideResNet are ``unsupported``, as in the paper (Megatron-LM had no such
model: "-" in Figure 7). Megatron's linear layers carry biases where the HF model has none
(GPT-Neo's Q/K/V); the record's notes say so.

Checkpointing (``CKPT``): ``full`` recomputes every layer (``recompute_granularity='full'``,
uniform, one layer per chunk), ``selective`` recomputes the core attention; 0 = none.
Training: every rank sees the whole batch (data parallel size 1) and AdamW steps fp32
parameters. In bf16 on CUDA the model trains as Megatron-LM's ``--bf16`` does: the whole model
in bf16 with fp32 master copies, no autocast, the softmax and the loss in float32
(``TransformerConfig(bf16=True)``, :mod:`.master_weights`; as Slapo-TP trains; not Megatron-LM's
distributed optimizer). fp16 runs under autocast over fp32 parameters with a GradScaler.

On CUDA the model takes the fastest path megatron-core has without Transformer Engine or Apex
(:data:`CUDA_FUSIONS`, named in the record): its ``torch.compile``-fused bias+activation
(GeLU, which megatron fuses as the tanh approximation, or SwiGLU), bias+dropout+residual add
and cross entropy. Its attention stays the local ``DotProductAttention``, which writes out the
``[b, heads, s, s]`` scores and takes their softmax in fp32: megatron-core's fused and flash
attention are Transformer Engine's. That is why it trails HF with SDPA at sequence 512-1024;
the record says so. On CPU the unfused path runs (compiling costs more than it saves there).
On CPU the :mod:`.megatron_cpu` adapter is installed. A case with pipeline stages or
data-parallel replicas (``pp=``, ``tp=``) runs under :mod:`.megatron_3d`, a subclass.
"""
from __future__ import annotations

import functools

import torch

from .base import TensorParallelTrainer

# megatron-core's fusions that need neither Transformer Engine nor Apex (its jit_fuser is
# torch.compile); masked-softmax, RoPE and gradient-accumulation fusion need their kernels.
CUDA_FUSIONS = {"bias_dropout_fusion": True, "cross_entropy_loss_fusion": True}
# Families whose MLP activation megatron fuses with its bias (bias_activation_fusion): GeLU
# (fused as the tanh approximation: GPT-Neo's own, BERT's within 1e-3) and SwiGLU.
FUSED_ACTIVATION = {"bert": "gelu", "gpt_neo": "gelu", "llama": "swiglu"}
# Megatron-LM pads the vocabulary to a multiple of 128 x the tensor-parallel size
# (--make-vocab-size-divisible-by, its default): megatron-core's vocabulary-parallel embedding
# needs a vocabulary the ranks divide (BERT's 30522 on 4 ranks, GPT-Neo's 50257 on 2 would
# stop it), and the LM head's matmuls then run on aligned shapes.
VOCAB_DIVISIBLE_BY = 128
SLOW_ATTENTION = ("megatron-core's attention here is its local DotProductAttention (no "
                  "Transformer Engine): it writes out the [b, heads, s, s] scores with an fp32 "
                  "softmax, where HF's SDPA runs a flash kernel")
# Families whose norm megatron-core builds as torch's RMSNorm (its local spec, without TE).
RMS_NORM_FAMILIES = ("llama", "t5")
SLOW_RMS_NORM = ("its RMSNorm is torch's, whose fp32 weights (the master weights under "
                 "autocast) meet 16-bit inputs: torch takes its unfused path")


def cuda_fusions(family: str, fp32_weights: bool = True) -> tuple[dict, str]:
    """The ``TransformerConfig`` fields of the :data:`CUDA_FUSIONS` (and the activation's)
    for ``family``, and the record's note. A fused GeLU is given as ``F.gelu``, which
    megatron computes as the tanh approximation. ``fp32_weights``: the model runs under
    autocast over fp32 parameters (not in bf16 with master copies)."""
    fields = dict(CUDA_FUSIONS)
    act = FUSED_ACTIVATION.get(family)
    if act is not None:
        fields["bias_activation_fusion"] = True
        fields["activation_func"] = (torch.nn.functional.gelu if act == "gelu"
                                     else torch.nn.functional.silu)
    fused = ", ".join(sorted(k for k in fields if k.endswith("fusion")))
    detail = {"gelu": " (gelu, as its tanh approximation)", "swiglu": " (swiglu)"}.get(act, "")
    slow = f"; {SLOW_RMS_NORM}" if family in RMS_NORM_FAMILIES and fp32_weights else ""
    return fields, (f"megatron-core fusions on CUDA (no Transformer Engine or Apex): "
                    f"{fused}{detail}; {SLOW_ATTENTION}{slow}")


def padded_vocab_size(vocab: int, tp: int) -> int:
    """``vocab`` padded as Megatron-LM pads it for ``tp`` tensor-parallel ranks."""
    multiple = VOCAB_DIVISIBLE_BY * tp
    return -(-vocab // multiple) * multiple


def _family(spec) -> str:
    from slapo_ae.zoo import model_family

    return model_family(spec.case.model)


class MegatronSystem(TensorParallelTrainer):
    mode = "megatron"
    description = "megatron-core's own model, tensor parallelism = ranks"

    pp_size = 1  # pipeline stages (megatron_3d: the case's pp)

    def cuda_context(self):
        """Where megatron-core runs code that assumes CUDA (none with TP alone)."""
        import contextlib

        return contextlib.nullcontext()

    # -- building ------------------------------------------------------------------------
    def setup(self) -> None:
        from megatron.core import parallel_state, tensor_parallel

        from slapo_ae.zoo import hf_config

        from .base import hf_overrides

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=self.tp_size,
                                                 pipeline_model_parallel_size=self.pp_size)
        if self.ctx.device.type == "cpu":
            from . import megatron_cpu

            megatron_cpu.install(self.spec.case.seed,
                                 parallel_state.get_tensor_model_parallel_rank())
        else:
            tensor_parallel.model_parallel_cuda_manual_seed(self.spec.case.seed)
        torch.manual_seed(self.spec.case.seed)
        self.family = _family(self.spec)
        self.hf = hf_config(self.spec.case.model, **hf_overrides(self.spec))
        # what megatron's embedding and LM head hold; the padded words take part in the
        # loss's softmax, as in Megatron-LM, and no token of the data is one of them
        self.vocab_size = padded_vocab_size(self.hf.vocab_size, self.tp_size)
        if self.vocab_size != self.hf.vocab_size:
            self.notes.append(
                f"vocabulary padded from {self.hf.vocab_size} to {self.vocab_size} words, as "
                f"Megatron-LM pads it (--make-vocab-size-divisible-by {VOCAB_DIVISIBLE_BY} x TP "
                f"{self.tp_size}); the padded words take part in the loss's softmax")
        builder = {"bert": self._bert, "gpt_neo": self._gpt_neo, "llama": self._llama,
                   "t5": self._t5}[self.family]
        self.set_precision()  # the config says whether the model runs in bf16
        with self.cuda_context():
            self.model = builder()
        if self.ctx.device.type == "cuda":
            self.model.cuda(self.ctx.device)
        self.make_optimizer()

    def _config(self, **fields):
        from megatron.core.transformer.transformer_config import TransformerConfig

        recompute = {}
        if self.spec.case.ckpt == "full":
            recompute = dict(recompute_granularity="full", recompute_method="uniform",
                             recompute_num_layers=1)
        elif self.spec.case.ckpt == "selective":
            recompute = dict(recompute_granularity="selective")
        return TransformerConfig(
            tensor_model_parallel_size=self.tp_size,
            pipeline_model_parallel_size=self.pp_size,
            use_cpu_initialization=self.ctx.device.type == "cpu",
            params_dtype=torch.float32, pipeline_dtype=torch.float32,
            bf16=self.uses_master_weights(),  # bf16 activations: softmax upcast to fp32
            **recompute, **{**fields, **self.fusions()})

    def uses_master_weights(self) -> bool:
        """bf16: the whole model in bf16 with fp32 masters, as Megatron-LM trains (the module
        docstring); megatron-core's losses upcast the logits to float32. Pipelines and
        replicas (:mod:`.megatron_3d`) keep autocast."""
        return self.autocast_dtype == torch.bfloat16

    def fusions(self) -> dict:
        """:func:`cuda_fusions` on CUDA, none on CPU; the record's note once."""
        if self.ctx.device.type != "cuda":
            return {}
        fields, note = cuda_fusions(self.family, fp32_weights=not self.uses_master_weights())
        if note not in self.notes:
            self.notes.append(note)
        return fields

    def _bert(self):
        from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
        from megatron.core.models.bert.bert_model import BertModel

        c = self.hf
        config = self._config(
            num_layers=c.num_hidden_layers, hidden_size=c.hidden_size,
            num_attention_heads=c.num_attention_heads, ffn_hidden_size=c.intermediate_size,
            layernorm_epsilon=c.layer_norm_eps, hidden_dropout=c.hidden_dropout_prob,
            attention_dropout=c.attention_probs_dropout_prob,
            activation_func=torch.nn.functional.gelu)
        self.notes.append("Megatron's BERT: pre-LayerNorm layers, no next-sentence head")
        return BertModel(config=config, num_tokentypes=c.type_vocab_size,
                         transformer_layer_spec=bert_layer_local_spec, vocab_size=self.vocab_size,
                         max_sequence_length=c.max_position_embeddings, add_binary_head=False,
                         share_embeddings_and_output_weights=True, parallel_output=True)

    def _gpt(self, config, spec, **kwargs):
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel

        # this rank's stage: the embedding on the first, the LM head and loss on the last
        return GPTModel(config=config, transformer_layer_spec=spec,
                        vocab_size=self.vocab_size, parallel_output=True,
                        pre_process=parallel_state.is_pipeline_first_stage(),
                        post_process=parallel_state.is_pipeline_last_stage(), **kwargs)

    def _gpt_neo(self):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        c = self.hf
        config = self._config(
            num_layers=c.num_layers, hidden_size=c.hidden_size, num_attention_heads=c.num_heads,
            ffn_hidden_size=c.intermediate_size or 4 * c.hidden_size,
            layernorm_epsilon=c.layer_norm_epsilon, hidden_dropout=c.resid_dropout,
            attention_dropout=c.attention_dropout,
            activation_func=functools.partial(torch.nn.functional.gelu, approximate="tanh"),
            add_qkv_bias=True)
        if "local" in c.attention_layers:
            self.notes.append("GPT-Neo's local (windowed) attention cannot be represented in "
                              "megatron-core: every layer uses global causal attention")
        self.notes.append("megatron's Q/K/V projections carry biases (GPT-Neo's have none)")
        return self._gpt(config, get_gpt_layer_local_spec(),
                         max_sequence_length=c.max_position_embeddings,
                         position_embedding_type="learned_absolute",
                         share_embeddings_and_output_weights=c.tie_word_embeddings)

    def _llama(self):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        c = self.hf
        heads = c.num_attention_heads
        config = self._config(
            num_layers=c.num_hidden_layers, hidden_size=c.hidden_size, num_attention_heads=heads,
            num_query_groups=getattr(c, "num_key_value_heads", None) or heads,
            kv_channels=getattr(c, "head_dim", None) or c.hidden_size // heads,
            ffn_hidden_size=c.intermediate_size, normalization="RMSNorm",
            layernorm_epsilon=c.rms_norm_eps, gated_linear_unit=True,
            activation_func=torch.nn.functional.silu, add_bias_linear=False,
            hidden_dropout=0.0, attention_dropout=getattr(c, "attention_dropout", 0.0))
        theta = getattr(c, "rope_theta", None)
        if theta is None:  # transformers 5 keeps it in rope_parameters
            theta = (getattr(c, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        return self._gpt(config, get_gpt_layer_local_spec(normalization="RMSNorm"),
                         max_sequence_length=c.max_position_embeddings,
                         position_embedding_type="rope", rotary_base=theta,
                         share_embeddings_and_output_weights=c.tie_word_embeddings)

    def _t5(self):
        from megatron.core.models.T5 import T5Model
        from megatron.core.models.T5.t5_spec import (
            get_t5_decoder_with_local_block_spec,
            get_t5_encoder_with_local_block_spec,
        )

        c = self.hf
        gated = c.feed_forward_proj.startswith("gated")
        act = torch.nn.functional.relu if "relu" in c.feed_forward_proj else functools.partial(
            torch.nn.functional.gelu, approximate="tanh")
        fields = dict(hidden_size=c.d_model, num_attention_heads=c.num_heads,
                      kv_channels=c.d_kv, ffn_hidden_size=c.d_ff, normalization="RMSNorm",
                      layernorm_epsilon=c.layer_norm_epsilon, add_bias_linear=False,
                      gated_linear_unit=gated, activation_func=act,
                      hidden_dropout=c.dropout_rate, attention_dropout=c.dropout_rate)
        dec_layers = c.num_decoder_layers or c.num_layers
        encoder_config = self._config(num_layers=c.num_layers, **fields)
        config = self._config(num_layers=dec_layers, **fields)
        self.decoder_start = c.decoder_start_token_id or 0
        self.notes.append("T5 with learned absolute positions, as Megatron-LM's T5: relative "
                          "position buckets need an attention bias, which megatron-core's "
                          "local attention does not take")
        return T5Model(
            config=config, encoder_config=encoder_config,
            transformer_encoder_layer_spec=get_t5_encoder_with_local_block_spec(c.num_layers),
            transformer_decoder_layer_spec=get_t5_decoder_with_local_block_spec(dec_layers),
            vocab_size=self.vocab_size,
            max_sequence_length=max(self.spec.case.seq_len, self.spec.case.dec_seq_len),
            position_embedding_type="learned_absolute",
            share_embeddings_and_output_weights=c.tie_word_embeddings, parallel_output=True)

    # -- one step --------------------------------------------------------------------------
    def forward_loss(self, batch: dict) -> torch.Tensor:
        ids = batch["input_ids"]
        b, s = ids.shape
        dev = ids.device
        if self.family == "bert":
            loss, _ = self.model(ids, batch["attention_mask"],
                                 tokentype_ids=torch.zeros_like(ids), lm_labels=batch["labels"])
        elif self.family == "t5":
            labels = batch["labels"]
            t = labels.shape[1]
            dec_ids = torch.cat([torch.full((b, 1), self.decoder_start, dtype=labels.dtype,
                                            device=dev), labels[:, :-1]], dim=1)
            no_mask = torch.zeros(b, 1, s, s, dtype=torch.bool, device=dev)
            causal = torch.triu(torch.ones(t, t, dtype=torch.bool, device=dev), 1)[None, None]
            cross = torch.zeros(b, 1, t, s, dtype=torch.bool, device=dev)
            loss = self.model(ids, dec_ids, no_mask, causal.expand(b, 1, t, t), cross,
                              lm_labels=labels)
        else:
            loss = gpt_forward(self.model, ids)
        return loss.float().mean()


def gpt_forward(model, ids: torch.Tensor) -> torch.Tensor:
    """A GPTModel (or one pipeline stage of it) on ``ids`` with next-token labels, an explicit
    causal mask and positions 0..s-1: the per-token losses on the last stage, else the hidden
    states the next stage takes."""
    b, s = ids.shape
    labels = torch.roll(ids, -1, dims=1)
    pos = torch.arange(s, device=ids.device).unsqueeze(0).expand(b, s)
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=ids.device), 1)[None, None]
    return model(ids, pos, causal, labels=labels)
