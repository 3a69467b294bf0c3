"""Schedule building blocks shared by the model families (library code: not counted as
schedule lines in Table 4).

Each helper applies slapo primitives (``shard``, ``sync``, ``replace``, ``fork_rng``) to
schedule nodes, so a family's schedule reads as a short list of decisions:

- ``shard_column_row``: Megatron's pair of a column-parallel and a row-parallel projection;
- ``divide_heads``: keep a module's head counts consistent with its sharded projections;
- ``shard_attention``: the two above on an attention module, and ``fork_rng`` on its
  attention-probability dropout;
- ``shard_vocab``: vocabulary-parallel embedding and LM head, and the loss computed on the
  sharded logits (``vocab_parallel_loss``) instead of gathering them;
- ``shard_batchnorm``: a BatchNorm over sharded channels (parameters and running statistics);
- ``use_sdpa`` / ``sdpa_gpt_neo``: attention through ``slapo.op.attention`` (SDPA);
- ``use_device_dropout``: dropout through ``slapo.op.Dropout`` (its mask drawn the way that is
  fast on the device); ``use_kernels``: this and ``use_sdpa``, what every transformer takes;
- ``fuse_bias_gelu``: a Linear followed by GeLU becomes ``slapo.op.LinearGeLU``.

Apply kernel replacements (``use_kernels``, ``sdpa_gpt_neo``, ``fuse_bias_gelu``) before sharding
and before ``fork_rng``/``checkpoint``: ``replace`` installs a new module, and what was
attached to the old one (hooks, wrapped forwards) would not carry over.
"""

from __future__ import annotations

import functools
import types

import torch.nn.functional as F
from torch import nn

from ..op import (
    CoreAttention,
    Dropout,
    LinearGeLU,
    gelu_approximation,
    register_hf_attention,
    vocab_parallel_cross_entropy,
)
from ..sharding import all_reduce_backward
from ..sharding.overlap import supports_overlap


def tensor_parallel(sch, opts) -> bool:
    """Whether to shard: tensor parallelism requested and more than one rank in the group."""
    return opts.tensor_parallel and sch.world_size > 1


def shard_column_row(node, columns: list[str], row: str, input_sync: str = "") -> None:
    """Megatron's pair: ``columns`` split by output features (their biases follow), ``row``
    split by input features, its partial sums all-reduced in the forward and its bias added
    once; the gradient of the input of ``node[input_sync]`` (the module whose input feeds the
    column projections; ``""`` is ``node`` itself) all-reduced in the backward, overlapped with
    the column linears' weight gradients (``sync``'s ``overlap``)."""
    for name in columns:
        node[name].shard("weight", axis=0)
    node[input_sync].sync("bwd_post", "all_reduce", overlap=_below(node, input_sync, columns))
    node[row].shard("weight", axis=1)
    node[row].sync("fwd_post", "all_reduce")


def _below(node, top: str, columns: list[str]) -> list[str]:
    """The ``columns`` (paths relative to ``node``) that lie at or below ``node[top]``, as
    paths relative to it, and that can overlap their weight gradient with the all-reduce of
    ``node[top]``'s input gradient (linears; not convolutions)."""
    found = []
    for path in columns:
        if top and path != top and not path.startswith(top + "."):
            continue
        rel = path[len(top):].lstrip(".") if top else path
        if supports_overlap(node[path].mod):
            found.append(rel)
    return found


def divide_heads(node, *attrs: str) -> None:
    """Divide the attributes ``attrs`` of ``node.mod`` (head counts, inner sizes) by the world
    size, for modules whose forward reads them to split or merge heads."""
    world = node.world_size
    for attr in attrs:
        value = getattr(node.mod, attr)
        if value % world:
            raise ValueError(f"{node.path}.{attr} = {value} is not divisible by {world} ranks")
        setattr(node.mod, attr, value // world)


def shard_attention(attn, qkv: list[str], out: str, heads: tuple[str, ...] = (),
                    dropout: str = "", input_sync: str = "") -> None:
    """Megatron's attention: this rank keeps ``1/world`` of the heads. The projections ``qkv``
    are column-parallel and ``out`` row-parallel (``shard_column_row``, with ``input_sync``),
    the head-count attributes ``heads`` of ``attn.mod`` are divided (``divide_heads``), and
    ``attn[dropout]``, the module whose dropout acts on the attention probabilities (this
    rank's heads only), draws from the per-rank stream (``fork_rng``). Dropout on the
    replicated output after ``out`` must not lie inside ``attn[dropout]``."""
    shard_column_row(attn, qkv, out, input_sync)
    divide_heads(attn, *heads)
    attn[dropout].fork_rng()


def shard_vocab(sch, embeddings: list[str], head: str, loss: str | None) -> None:
    """Vocabulary parallelism: each embedding in ``embeddings`` looks up this rank's slice of
    the vocabulary (partial sums all-reduced), and the LM ``head`` produces this rank's slice of
    the logits (its shard is a no-op when tied to an embedding). With ``loss`` (a kind of
    ``vocab_parallel_loss``) the model's loss is computed on the sharded logits and no rank
    holds full logits; with ``loss=None`` the logits are all-gathered to the full vocabulary
    and the model computes its own loss."""
    for path in embeddings:
        sch[path].shard("weight", axis=0)
        sch[path].sync("fwd_post", "all_reduce")
    sch[head].shard("weight", axis=0)
    sch[head].sync("bwd_post", "all_reduce")
    if loss is None:
        sch[head].sync("fwd_post", "all_gather", axis=-1, tensor_parallel_output_grad=False)
    else:
        vocab_parallel_loss(sch, loss)


LOSS_KINDS = ("causal", "masked", "seq2seq")


def vocab_parallel_loss(sch, kind: str) -> None:
    """Make the root model compute its loss with ``vocab_parallel_cross_entropy``.

    ``model(**batch)`` still returns the model's output class with ``.loss`` first; the labels
    are not passed to the HF forward (so it computes no loss of its own on sharded logits),
    and ``.logits`` holds this rank's vocabulary slice. ``kind``:
    ``"causal"`` (token ``t`` predicts label ``t+1``, as HF's causal-LM loss),
    ``"masked"`` (each token predicts its own label, as HF's MLM loss),
    ``"seq2seq"`` (T5: decoder inputs made from the labels with ``model._shift_right``).
    Labels equal to -100 are ignored.
    """
    if kind not in LOSS_KINDS:
        raise ValueError(f"unknown loss kind {kind!r}; expected one of {LOSS_KINDS}")
    model, group = sch.mod, sch.group
    inner = model.forward

    @functools.wraps(inner)
    def forward(*args, labels=None, **kwargs):
        if labels is None:
            return inner(*args, **kwargs)
        if kind == "seq2seq" and kwargs.get("decoder_input_ids") is None \
                and kwargs.get("decoder_inputs_embeds") is None:
            kwargs["decoder_input_ids"] = model._shift_right(labels)
        out = inner(*args, **kwargs)
        target = labels.to(out.logits.device)
        if kind == "causal":
            target = F.pad(target, (0, 1), value=-100)[..., 1:]
        loss = vocab_parallel_cross_entropy(out.logits, target, group)
        return type(out)(loss=loss, **{k: v for k, v in out.items() if k != "loss"})

    model.forward = forward


def shard_batchnorm(bn) -> None:
    """Shard a BatchNorm over channels split across ranks: per-channel statistics need no
    communication (each rank normalises its channels over the whole batch), so the affine
    parameters and the running statistics are simply sliced."""
    bn.shard(["weight", "bias"], axis=0)
    mod, world, rank = bn.mod, bn.world_size, bn.rank
    for name in ("running_mean", "running_var"):
        buf = getattr(mod, name, None)
        if buf is not None:
            setattr(mod, name, buf.chunk(world)[rank].clone())
    mod.num_features //= world


def _configs(module: nn.Module) -> list:
    seen = {}
    for sub in module.modules():
        config = getattr(sub, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            seen[id(config)] = config
    return list(seen.values())


def use_sdpa(sch) -> None:
    """Run the attention of every module below ``sch`` that dispatches through transformers'
    attention interface (BERT, RoBERTa, OPT, LLaMA, T5) through ``slapo.op.attention``; masks
    are then built as for HF's SDPA path (boolean, or None when nothing is padded)."""
    name = register_hf_attention()
    for config in _configs(sch.mod):
        config._attn_implementation = name


def use_device_dropout(sch) -> None:
    """Every ``nn.Dropout`` below ``sch`` becomes ``slapo.op.Dropout`` with the same ``p``: on
    CPU its mask comes from uniform draws instead of ``bernoulli_`` (twice as fast here), on
    CUDA it is ``F.dropout`` (``slapo.op.dropout``)."""
    for path, mod in list(sch.mod.named_modules()):
        if type(mod) is nn.Dropout:
            sch[path].replace(Dropout(mod.p))


def use_kernels(sch) -> None:
    """The ``slapo.op`` kernels every transformer family takes: attention through SDPA
    (``use_sdpa``) and dropout drawn for the device (``use_device_dropout``)."""
    use_sdpa(sch)
    use_device_dropout(sch)


def _gpt_neo_attn(self, query, key, value, attention_mask=None):
    """GPTNeoSelfAttention._attn on SDPA: the layer's causal (or local-window) mask, no
    scaling, the model's padding mask; q and k stay in their dtype (HF upcasts them to fp32)."""
    return self.core(query, key, value, attention_mask), None


def sdpa_gpt_neo(attn) -> None:
    """Give a GPTNeoSelfAttention an SDPA core: child ``core`` (a ``CoreAttention`` with the
    layer's window, scale 1.0 and probability dropout) computes what ``_attn`` did."""
    mod = attn.mod
    window = mod.config.window_size if mod.attention_type == "local" else None
    mod.core = CoreAttention(causal=True, window=window, scale=1.0, dropout=mod.attn_dropout.p)
    mod._attn = types.MethodType(_gpt_neo_attn, mod)
    attn._rebuild_children()


def fuse_bias_gelu(linear, act) -> None:
    """Replace ``linear`` (an ``nn.Linear`` whose output goes to the GeLU module ``act``) with
    ``slapo.op.LinearGeLU`` and ``act`` with the identity. The GeLU flavour (erf or tanh) is
    read from ``act``; anything else than a GeLU is refused."""
    approximate = gelu_approximation(act.mod)
    if approximate is None:
        raise ValueError(f"{act.path} is a {type(act.mod).__name__}, not a GeLU to fuse")
    linear.replace(LinearGeLU.from_linear(linear.mod, approximate))
    act.replace(nn.Identity())


def all_reduce_output_grad(node) -> None:
    """All-reduce, in the backward, the gradient of ``node``'s (first) output: for an output
    consumed only by column-parallel projections elsewhere (T5's encoder output, read by the
    decoder's cross-attention keys and values), one all-reduce replaces one per consumer."""
    group = node.group
    node.sync("fwd_post", lambda out: all_reduce_backward(out, group))
