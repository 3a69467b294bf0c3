"""Every family's TP=2 schedule trains under bf16 autocast, as the harness trains on a GPU,
and agrees with the plain model under the same autocast.

Until 2026-12-05 it did not: the column-parallel linears whose weight gradients overlap the
input-gradient all-reduce (``slapo.sharding.overlap``) multiplied a bf16 gradient by an fp32
weight in their backward, and every Slapo-TP case on 2 or more GPUs would have stopped at its
first step (all fp32 CPU tests passed).

Set-up: the tiny config of each family, dropout off, 2 CPU ranks over gloo, the ``full``
schedule (embedding sharded, kernels, checkpoint ratio 0.5), one step on the batch of the
other proofs, both models under ``torch.autocast("cpu", torch.bfloat16)``; BERT also with its
layers compiled, as on a GPU (``compile_layers``: Inductor, here for the CPU). Two bf16
computations that sum in different orders differ by bf16's rounding (8 bits of mantissa),
which the tolerances allow: loss 1e-3, logits 2e-2, each gradient 0.1 (measured on
2026-12-05: at most 3e-4, 7e-3 and 0.08, OPT's LayerNorm bias, whose gradient is small). A
wrong dtype, a missing reduction or a lost bias is off by tens of percent.
"""

import copy

import pytest
import torch
from distributed import run_ranks
from sched_helpers import TINY, loss_and_logits, padded_batches

import slapo
from slapo.model_schedule import schedule_model
from slapo.verify import train_side_by_side
from slapo_ae.zoo import build_model, no_dropout

LOSS_TOL, OUTPUT_TOL, GRAD_TOL = 1e-3, 2e-2, 0.1
FAMILIES = {family: name for family, name in TINY.items() if family != "wideresnet"}


def _autocast_forward(model, batch):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return loss_and_logits(model, batch)


CASES = {**{family: (name, False) for family, name in FAMILIES.items()},
         "bert, compiled layers": ("bert-tiny", True)}


def _under_autocast():
    torch.manual_seed(0)
    results = {}
    for case, (name, compiled) in CASES.items():
        plain = build_model(name, **no_dropout(name))
        sch = slapo.create_schedule(copy.deepcopy(plain))
        schedule_model(sch, device="cpu", tensor_parallel=True, shard_embedding=True,
                       kernel_opt=True, ckpt_ratio=0.5, compile_layers=compiled)
        scheduled = slapo.build_module(sch)
        batch = padded_batches(plain.config, steps=1)
        results[case] = train_side_by_side(plain, scheduled, batch, _autocast_forward)[0]
    return results


@pytest.fixture(scope="module")
def autocast_results():
    return run_ranks(_under_autocast)


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_schedule_trains_under_bf16_autocast(autocast_results, case):
    for rank, results in enumerate(autocast_results):
        report = results[case]
        what = f"{case} rank {rank}"
        assert report.loss_error <= LOSS_TOL, \
            f"{what}: loss {report.loss_scheduled} vs {report.loss_plain}"
        assert report.output_error <= OUTPUT_TOL, f"{what}: logits off by {report.output_error}"
        name, err = report.max_grad_error
        assert err <= GRAD_TOL, f"{what}: gradient of '{name}' off by {err:.2e}"
