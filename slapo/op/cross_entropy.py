"""Cross entropy over logits sharded along the vocabulary across a tensor-parallel group.

Rank ``r`` of ``p`` holds the logits of vocabulary ids ``[r*V/p, (r+1)*V/p)`` (what a
vocabulary-parallel LM head produces). The loss of a token with target ``t`` is
``log(sum_v exp(z_v)) - z_t``, computed without gathering the logits:

1. ``m = max_v z_v``: local max, then an all-reduce (MAX) across the group;
2. ``s = sum_v exp(z_v - m)``: local sum, then an all-reduce (SUM);
3. ``z_t - m``: taken on the rank that owns ``t`` (zero elsewhere), then an all-reduce (SUM);
4. ``loss = log(s) - (z_t - m)``.

The backward is local: ``d loss / d z_v = softmax(z)_v - [v == t]``, scaled by the incoming
gradient; each rank writes its own vocabulary slice (in the saved softmax buffer, so a graph
through this loss supports one backward). Targets equal to ``ignore_index`` give
loss 0 and zero gradient, and the mean is taken over the other tokens, as
``F.cross_entropy(..., ignore_index=-100)`` does. Computation is in float32 (like HF's losses).
With world size 1 (or no process group) it is a plain cross entropy. Given ``vocab_size``, the
logits of ids past it (a vocabulary padded so that the ranks divide it, ``shard(pad=True)``)
are left out: as if they were -inf, so they get no probability and no gradient.

Also here: upstream's module of it (``ParallelCrossEntropy``), and the same loss on unsharded
logits compiled into one region
(``compiled_cross_entropy``, ``compiled_loss``), the kernel path's loss on CUDA.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import state


def _world_and_rank(group) -> tuple[int, int]:
    if not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _all_reduce(x: torch.Tensor, op, group, world: int) -> torch.Tensor:
    if world > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, group, vocab_size):
        world, rank = _world_and_rank(group)
        ctx.dtype = logits.dtype
        logits = logits.float()
        part = logits.shape[-1]
        start = rank * part
        if vocab_size is not None and start + part > vocab_size:  # padding: no such words
            padding = torch.arange(start, start + part, device=logits.device) >= vocab_size
            logits = logits.masked_fill(padding, float("-inf"))
        # 1. global max, for a stable log-sum-exp
        gmax = _all_reduce(logits.max(dim=-1).values, dist.ReduceOp.MAX, group, world)
        shifted = logits - gmax.unsqueeze(-1)
        # 3. the (shifted) target logit, from the rank that owns the target id
        valid = target != ignore_index
        local = target - start
        owned = valid & (local >= 0) & (local < part)
        local = local.masked_fill(~owned, 0)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0.0)
        picked = _all_reduce(picked, dist.ReduceOp.SUM, group, world)
        # 2. the partition function
        exp = shifted.exp_()
        total = _all_reduce(exp.sum(dim=-1), dist.ReduceOp.SUM, group, world)
        loss = (total.log() - picked).masked_fill(~valid, 0.0)
        ctx.save_for_backward(exp.div_(total.unsqueeze(-1)), local, owned, valid)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local, owned, valid = ctx.saved_tensors
        grad = softmax  # reused in place: the forward's buffer is not needed again
        # less 1 at each owned target (local is 0 where not owned, and adds 0 there): a scatter,
        # where indexing by owned.nonzero() would wait for the GPU at every step
        grad.scatter_add_(-1, local.unsqueeze(-1), -owned.unsqueeze(-1).to(grad.dtype))
        grad.mul_((grad_loss * valid).unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group=None,
                                 ignore_index: int = -100, reduction: str = "mean",
                                 vocab_size: int | None = None) -> torch.Tensor:
    """Cross entropy of ``logits`` (``[..., V/p]``, this rank's vocabulary slice) against
    ``target`` (``[...]``, global ids). ``reduction``: ``"mean"`` over non-ignored tokens,
    ``"sum"``, or ``"none"`` (per token, 0 where ignored). ``vocab_size``: the words there
    are, where the ranks' slices hold padding past them (left out of the softmax). The result
    is the same on every rank.
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)} "
                         "disagree outside the vocabulary axis")
    losses = _VocabParallelCrossEntropy.apply(logits, target, ignore_index, group, vocab_size)
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    if reduction == "mean":
        return losses.sum() / (target != ignore_index).sum()
    raise ValueError(f"unknown reduction {reduction!r}; expected 'mean', 'sum' or 'none'")


LOSS_KINDS = ("causal", "masked", "seq2seq")


class ParallelCrossEntropy(torch.nn.Module):
    """Upstream's module of the loss: the per-token losses of vocabulary-sharded logits
    (``reduction="none"``); here, where upstream's scripts import it from."""

    def __init__(self, group=None):
        super().__init__()
        self.group = group

    def forward(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(outputs, labels, self.group, reduction="none")


def _logits_and_target(output, target: torch.Tensor, kind: str):
    """The logits in a model's ``output`` (the logits, a tuple holding them first, or a dict
    holding them as ``"logits"``) and ``target`` lined up with them: for ``"causal"``, token
    ``t``'s label is ``t+1``'s (the last token's is ignored)."""
    if kind not in ("causal", "masked"):
        raise ValueError(f"loss kind {kind!r}: a loss from the output alone is 'causal' or "
                         "'masked' (seq2seq makes the decoder's inputs from the labels)")
    if isinstance(output, dict):
        logits = output["logits"]
    elif isinstance(output, (tuple, list)):
        logits = output[0]
    else:
        logits = output
    target = target.to(logits.device)
    if kind == "causal":
        target = F.pad(target, (0, 1), value=-100)[..., 1:]
    return logits, target


def vocab_parallel_output_loss(output, target: torch.Tensor, kind: str = "causal",
                               group=None, vocab_size: int | None = None) -> torch.Tensor:
    """The loss ``vocab_parallel_loss`` computes, from the model's output and its labels: the
    ``loss_fn(output, target)`` of a pipeline's last stage once ``trace`` took that loss out of
    the model's forward. ``output``: the (vocabulary-sharded) logits, or a tuple holding them
    first, or a dict holding them as ``"logits"``; ``kind`` ``"causal"`` or ``"masked"``;
    ``vocab_size`` as :func:`vocab_parallel_cross_entropy`'s."""
    logits, target = _logits_and_target(output, target, kind)
    return vocab_parallel_cross_entropy(logits, target, group, vocab_size=vocab_size)


def _cross_entropy_fp32(logits: torch.Tensor, target: torch.Tensor,
                        ignore_index: int, columns: int | None = None) -> torch.Tensor:
    if columns is not None:  # the real words of a padded vocabulary
        logits = logits[..., :columns]
    return F.cross_entropy(logits.flatten(0, -2).float(), target.flatten(),
                           ignore_index=ignore_index)


def _leading_columns(logits: torch.Tensor) -> tuple[torch.Tensor, int | None]:
    """``(wider, columns)`` where ``logits`` is ``wider[..., :columns]`` (``PaddedLinear``'s
    logits: the real words of the padded product), else ``(logits, None)``. The compiled loss
    then slices inside its region, and its backward writes the wider gradient in the same
    pass; the slice's own backward, outside, would fill a vocabulary-sized gradient with zeros
    and copy the real columns into it (bert-large at batch 32: 1 GB each way a step)."""
    wider = logits._base
    if (wider is not None and wider.dim() == logits.dim()
            and wider.shape[:-1] == logits.shape[:-1] and wider.shape[-1] > logits.shape[-1]
            and wider.stride() == logits.stride()
            and wider.storage_offset() == logits.storage_offset()):
        return wider, logits.shape[-1]
    return logits, None


@functools.cache
def _compiled_cross_entropy():
    return torch.compile(_cross_entropy_fp32, dynamic=False)


def compiled_cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                           ignore_index: int = -100) -> torch.Tensor:
    """``F.cross_entropy`` of ``logits`` (``[..., V]``, any float dtype) in float32 against
    ``target`` (``[...]``), the mean over tokens not equal to ``ignore_index``, as HF's losses
    compute it, but compiled by ``torch.compile`` (Inductor): the up-cast, log-softmax and
    NLL are one pass over the logits, their backward another, where the eager loss writes out
    the logits in float32 and their log-softmax, forward and backward (about five times the
    logits' bytes more, for a vocabulary-sized tensor per token). Logits that are the first
    columns of a wider tensor (``PaddedLinear``'s) are read from it (``_leading_columns``)."""
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)} "
                         "disagree outside the vocabulary axis")
    source, columns = _leading_columns(logits)
    return _compiled_cross_entropy()(source, target, ignore_index, columns)


def compiled_output_loss(output, target: torch.Tensor, kind: str = "causal") -> torch.Tensor:
    """The loss ``compiled_loss`` computes, from the model's output and its labels (as
    :func:`vocab_parallel_output_loss`, with the full vocabulary on every rank)."""
    logits, target = _logits_and_target(output, target, kind)
    return compiled_cross_entropy(logits, target)


def _loss_at_root(sch, kind: str, output_loss) -> None:
    """Wrap the root model's forward so that, given ``labels``, it computes its loss as
    ``output_loss(output, labels, kind)`` instead of the model's own (see the callers)."""
    if kind not in LOSS_KINDS:
        raise ValueError(f"unknown loss kind {kind!r}; expected one of {LOSS_KINDS}")
    model = sch.mod
    inner = model.forward
    # A traced root hands this loss to the pipeline's last stage (trace). A pipeline of T5
    # takes the decoder's inputs as inputs, so its labels line up with the logits there.
    state.set_loss_fn(model, functools.partial(
        output_loss, kind="causal" if kind == "causal" else "masked"))

    @functools.wraps(inner)
    def forward(*args, labels=None, **kwargs):
        if labels is None:
            return inner(*args, **kwargs)
        if kind == "seq2seq" and kwargs.get("decoder_input_ids") is None \
                and kwargs.get("decoder_inputs_embeds") is None:
            kwargs["decoder_input_ids"] = model._shift_right(labels)
        out = inner(*args, **kwargs)
        # seq2seq labels line up with the decoder's logits, as masked ones with the tokens
        loss = output_loss(out.logits, labels, kind="causal" if kind == "causal" else "masked")
        return type(out)(loss=loss, **{k: v for k, v in out.items() if k != "loss"})

    model.forward = forward


def vocab_parallel_loss(sch, kind: str) -> None:
    """Make the root model of the schedule ``sch`` compute its loss with
    ``vocab_parallel_cross_entropy`` (for a model whose LM head yields vocabulary-sharded logits).

    ``model(**batch)`` still returns the model's output class with ``.loss`` first; the labels
    are not passed to the HF forward (so it computes no loss of its own on sharded logits),
    and ``.logits`` holds this rank's vocabulary slice. ``kind``:
    ``"causal"`` (token ``t`` predicts label ``t+1``, as HF's causal-LM loss),
    ``"masked"`` (each token predicts its own label, as HF's MLM loss),
    ``"seq2seq"`` (T5: decoder inputs made from the labels with ``model._shift_right``).
    Labels equal to -100 are ignored. A vocabulary padded so that the ranks divide it
    (``shard(pad=True)`` of the LM head's weight) is read from the head's shard spec, and the
    padded words are left out of the loss.

    Tracing the root afterwards (``trace`` at the root, for a pipeline) traces the model's own
    forward, without this wrapper: the traced model returns the sharded logits, and
    ``build(target="pipeline")`` computes this loss on its last stage
    (:func:`vocab_parallel_output_loss`; ``"seq2seq"`` as ``"masked"``: a pipeline of T5 takes
    the decoder's inputs as inputs).
    """
    _loss_at_root(sch, kind, functools.partial(vocab_parallel_output_loss, group=sch.group,
                                               vocab_size=real_vocab_size(sch.mod)))


def padded_vocab_spec(model):
    """The shard spec of ``model``'s LM head weight where its vocabulary shard is padded
    (``shard(pad=True)``), else None."""
    from ..primitives.shard import shard_spec
    from .linear import output_embedding

    head = output_embedding(model)
    spec = shard_spec(head.weight) if head is not None else None
    return spec if spec is not None and spec.padded else None


def real_vocab_size(model) -> int | None:
    """The words of ``model``'s LM head where its vocabulary shard is padded past them
    (``shard(pad=True)``), else None: nothing to leave out."""
    spec = padded_vocab_spec(model)
    return spec.full_shape[spec.axis] if spec is not None else None


def compiled_loss(sch, kind: str) -> None:
    """Make the root model of the schedule ``sch`` compute its loss with
    :func:`compiled_cross_entropy` (one compiled region for the loss, which the model's own
    forward computes eagerly), on the full logits; ``kind`` and everything else as
    :func:`vocab_parallel_loss`. Installed first and followed by ``vocab_parallel_loss`` (a
    schedule that shards the LM head after choosing its kernels), the later one computes the
    loss: it calls the forward without labels, which this wrapper passes through.
    """
    _loss_at_root(sch, kind, compiled_output_loss)
