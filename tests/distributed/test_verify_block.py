"""slapo.Verify around a block of primitives, on 2 gloo ranks: a correct TP schedule of
bert-tiny passes (vocabulary-sharded logits gathered), and a schedule that forgets the
backward all-reduce of a column-parallel input passes the forward but is caught on the
gradients, naming the parameter; the scheduled model is left as it was."""

import pytest
import torch
from distributed import run_ranks
from torch import nn

import slapo
from slapo.model_schedule import schedule_model
from slapo_ae.zoo import build_model, synthetic_batch


class MLP(nn.Module):
    """A replicated linear, then a column- and a row-parallel one: the first one's gradient
    needs the all-reduce of the column-parallel input's gradient."""

    def __init__(self):
        super().__init__()
        self.inp, self.up, self.down = nn.Linear(8, 8), nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(self.inp(x))))


def _shard_mlp(sch, backward_sync: bool):
    sch["up"].shard("weight", axis=0)
    if backward_sync:
        sch["up"].sync("bwd_post", "all_reduce")
    sch["down"].shard("weight", axis=1)
    sch["down"].sync("fwd_post", "all_reduce")


def _run():
    results = {}
    model = build_model("bert-tiny")
    batch = synthetic_batch(model.config, 2, 16, 0, seed=3)
    sch = slapo.create_schedule(model)
    with slapo.Verify(sch, example_inputs={"input_ids": batch["input_ids"]}):
        schedule_model(sch)
    results["bert"] = "passed"

    torch.manual_seed(0)
    x = torch.randn(4, 8)
    for backward_sync in (True, False):
        sch = slapo.create_schedule(MLP())
        try:
            with slapo.Verify(sch, example_inputs=[x]):
                _shard_mlp(sch, backward_sync)
            results[backward_sync] = "passed"
        except AssertionError as err:
            results[backward_sync] = str(err)
        results[f"grads left {backward_sync}"] = [p.grad for p in sch.mod.parameters()]
    return results


def test_verify_checks_forward_and_backward():
    for results in run_ranks(_run):
        assert results["bert"] == "passed"
        assert results[True] == "passed"
        assert "the gradient of 'inp." in results[False]  # the forward agreed
        for key in ("grads left True", "grads left False"):
            assert all(g is None for g in results[key])


def test_verify_refuses_a_model_already_scheduled():
    sch = slapo.create_schedule(MLP())
    sch["up"].sync("bwd_post", lambda g: g)
    with pytest.raises(ValueError, match="up already carry primitives"):
        with slapo.Verify(sch, example_inputs=[torch.randn(2, 8)]):
            pass
