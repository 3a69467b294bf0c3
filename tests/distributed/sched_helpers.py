"""Shared pieces of the model-schedule proofs: tiny models, padded batches, comparisons."""

from __future__ import annotations

import copy

import torch

import slapo
from slapo.model_schedule import apply_schedule, schedule_model
from slapo.sharding import gather_sharded
from slapo.verify import train_side_by_side
from slapo_ae.zoo import build_model, model_family, no_dropout, synthetic_batch

TINY = {"bert": "bert-tiny", "roberta": "roberta-tiny", "gpt_neo": "gpt-neo-tiny",
        "opt": "opt-tiny", "t5": "t5-tiny", "llama": "llama-tiny",
        "wideresnet": "wideresnet-tiny"}
TOL = 1e-5
STEPS = 3
SEQ, DEC_SEQ, PAD = 40, 24, 7  # 40 > GPT-Neo tiny's local window of 16
LR = 0.1

# WideResNet trains in float64 on batches of 8 images of 64x64 with SGD lr 0.01. BatchNorm
# amplifies the rounding of re-associated sums (partial convolutions summed across ranks): in
# float32 the bn1.bias gradient was off by 5.75e-3 at step 3 on an Intel Xeon (oneDNN's
# kernels there) and within 1e-5 on AMD EPYC, a property of the CPU, not of the schedule,
# which is exact (float64 errors ~1e-13 on both).
WIDERESNET = {"overrides": {"image_size": 64}, "batch_size": 8, "lr": 0.01,
              "dtype": torch.float64}


def padded_batches(config, steps: int = STEPS, batch_size: int = 2,
                   dtype: torch.dtype | None = None) -> list[dict]:
    """Synthetic batches for a model config whose last sequence ends in ``PAD`` padding tokens
    (mask 0; label -100 where the label is a copy of the input), so padding masks matter;
    floating-point inputs (images) in ``dtype`` where given."""
    batches = []
    for step in range(steps):
        batch = synthetic_batch(config, batch_size, SEQ, DEC_SEQ, seed=100 + step)
        if dtype is not None:
            batch = {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}
        if "attention_mask" in batch:
            batch["attention_mask"][-1, -PAD:] = 0
            if config.model_type != "t5":
                batch["labels"][-1, -PAD:] = -100
        batches.append(batch)
    return batches


def loss_and_logits(model, batch):
    """``(loss, full logits)``: vocabulary-sharded logits are gathered for the comparison."""
    out = model(**batch)
    logits = out.logits
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is not None and logits.shape[-1] != vocab:
        logits = gather_sharded(logits, -1)[..., :vocab]  # less a padded shard's padding
    return out.loss, logits


def side_by_side(name: str, steps: int = STEPS, dropout_off: bool = True, **options):
    """Train the plain tiny model and its scheduled copy side by side; returns the step
    reports and the scheduled model."""
    overrides = no_dropout(name) if dropout_off else {}
    wrn = model_family(name) == "wideresnet"
    plain = build_model(name, **overrides, **(WIDERESNET["overrides"] if wrn else {}))
    if wrn:
        plain = plain.to(WIDERESNET["dtype"])
    sch = slapo.create_schedule(copy.deepcopy(plain))
    schedule_model(sch, **options)
    scheduled = slapo.build_module(sch)
    batches = padded_batches(plain.config, steps, WIDERESNET["batch_size"] if wrn else 2,
                             dtype=WIDERESNET["dtype"] if wrn else None)
    reports = train_side_by_side(plain, scheduled, batches, loss_and_logits,
                                 lr=WIDERESNET["lr"] if wrn else LR)
    return reports, plain, scheduled


def assert_equal_training(reports, what: str, tol: float = TOL) -> None:
    assert len(reports) == STEPS, what
    for step, report in enumerate(reports):
        assert report.loss_error <= tol, \
            f"{what} step {step}: loss {report.loss_scheduled} vs {report.loss_plain}"
        assert report.output_error <= tol, f"{what} step {step}: output error {report.output_error}"
        name, err = report.max_grad_error
        assert err <= tol, f"{what} step {step}: gradient of '{name}' off by {err:.2e}"


def worst(reports) -> str:
    return ", ".join(f"{r.max_grad_error[1]:.1e}" for r in reports)


def backward_node_names(tensor) -> list[str]:
    """The class names of the autograd nodes behind ``tensor``, each node once."""
    seen, todo, names = set(), [tensor.grad_fn], []
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        todo.extend(fn for fn, _ in node.next_functions)
    return names


def dropout_loss_on_full_logits(model_class, config, batch: dict) -> float:
    """The training loss of ``model_class(config)`` (dropout on) scheduled by
    ``apply_schedule`` with full logits on each rank, from the same default stream on every
    rank, as a launcher seeds it: replicated dropout must then give every rank one loss. (A
    vocabulary-parallel loss would be one on all ranks by its all-reduces even where their
    hidden states differ.)"""
    torch.manual_seed(0)
    model = slapo.build_module(apply_schedule(model_class(config), config,
                                              shard_embedding=False)).train()
    torch.manual_seed(7)
    return model(**batch).loss.item()


def probability_dropout_stream(model_class, config, batch: dict) -> dict:
    """For a config with dropout on the attention probabilities only: whether the scheduled
    model's training forward left the default generator (which replicated dropout shares
    across ranks) where it was, the dropout drawing from the per-rank stream of ``fork_rng``,
    and whether the dropout acted."""
    torch.manual_seed(0)
    model = slapo.build_module(apply_schedule(model_class(config), config)).train()
    before = torch.get_rng_state()
    dropped = model(**batch).loss.item()
    untouched = torch.equal(torch.get_rng_state(), before)
    return {"default_stream_untouched": untouched,
            "dropout_acts": dropped != model.eval()(**batch).loss.item()}
