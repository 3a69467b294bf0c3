"""``sync("bwd_post", "all_reduce", overlap=...)`` on 2 gloo ranks: the column-parallel linears'
weight gradients are computed beside the input gradient's all-reduce (slapo.sharding.overlap),
and the model trains exactly as the plain one: Q/K/V-like linears sharing the input, a fused
bias+GeLU linear, a linear listed but called on another tensor, under activation checkpointing
too; and the overlap really runs (its autograd nodes are in the graph), and each call's
bookkeeping is freed with its graph."""

import copy
import gc
import time

import pytest
import torch
from distributed import run_ranks
from sched_helpers import backward_node_names
from torch import nn

import slapo
from slapo.op import LinearGeLU
from slapo.sharding.overlap import MarkedInput, PendingWeightGrads
from slapo.verify import train_side_by_side

TOL = 1e-5
RELEASE_POLLS = 100  # at most 10 s for other threads to free what they hold


class Block(nn.Module):
    """Three projections of one input (as Q, K, V), a fused bias+GeLU linear on the same
    input, one projection of a derived tensor (listed for overlap, but not fed the input
    itself), and a row-parallel output projection."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(8, 12), nn.Linear(8, 12), nn.Linear(8, 12, bias=False)
        self.up = LinearGeLU.from_linear(nn.Linear(8, 12))
        self.side = nn.Linear(8, 12)
        self.out = nn.Linear(12, 8)

    def forward(self, x):
        h = self.q(x) * self.k(x).sigmoid() + self.v(x) + self.up(x) + self.side(x * 2)
        return self.out(h)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.block = Block()

    def forward(self, x):
        return self.block(self.inp(x))


def _schedule(sch, checkpoint: bool):
    block = sch["block"]
    for name in ("q", "k", "v", "up", "side"):
        block[name].shard("weight", axis=0)
        if block[name].mod.bias is not None:
            block[name].shard("bias", axis=0)
    block.sync("bwd_post", "all_reduce", overlap=["q", "k", "v", "up", "side"])
    block["out"].shard("weight", axis=1)
    block["out"].sync("fwd_post", "all_reduce")
    if checkpoint:
        block.checkpoint()


def _loss(model, batch):
    out = model(batch["x"])
    return out.pow(2).mean(), out


def _run(checkpoint: bool):
    torch.manual_seed(0)
    plain = Net()
    sch = slapo.create_schedule(copy.deepcopy(plain))
    _schedule(sch, checkpoint)
    scheduled = slapo.build_module(sch)
    batches = [{"x": torch.randn(3, 5, 6, generator=torch.Generator().manual_seed(s))}
               for s in range(3)]
    reports = train_side_by_side(plain, scheduled, batches, _loss)
    return reports, set(backward_node_names(scheduled(batches[0]["x"]).sum()))


@pytest.mark.parametrize("checkpoint", [False, True])
def test_overlapped_weight_grads_train_as_the_plain_model(checkpoint):
    for reports, nodes in run_ranks(_run, checkpoint):
        assert {"_OverlapBackward", "_DeferredLinearBackward"} <= nodes
        for step, report in enumerate(reports):
            assert report.loss_error <= TOL, step
            assert report.output_error <= TOL, step
            assert report.max_grad_error[1] <= TOL, (step, report.max_grad_error)


def _calls_left_alive(checkpoint: bool) -> int:
    """Train 3 steps, then run a forward whose graph is dropped unused; count the overlap
    calls' objects still alive after a full collection."""
    torch.manual_seed(0)
    sch = slapo.create_schedule(Net())
    _schedule(sch, checkpoint)
    model = slapo.build_module(sch)
    for seed in range(3):
        x = torch.randn(3, 5, 6, generator=torch.Generator().manual_seed(seed))
        model(x).pow(2).mean().backward()
    model(x).sum()  # graph dropped without a backward
    # Some of these objects are freed on threads Python did not start (two a process, gloo's
    # workers, seen 2026-12-04), which let go of a finished all-reduce after wait() returned:
    # count again until none is left; a leak keeps them for good and still fails.
    for _ in range(RELEASE_POLLS):
        gc.collect()
        alive = sum(isinstance(o, (PendingWeightGrads, MarkedInput)) for o in gc.get_objects())
        if not alive:
            break
        time.sleep(0.1)
    return alive


@pytest.mark.parametrize("checkpoint", [False, True])
def test_each_call_is_freed_with_its_graph(checkpoint):
    # the views of the parameters once sat on the object the node's backward holds: a cycle
    # through autograd's graph that gc cannot free, 12 MB a step on t5-tiny at 2 ranks
    assert run_ranks(_calls_left_alive, checkpoint) == [0, 0]


def test_overlap_refuses_what_it_cannot_overlap():
    sch = slapo.create_schedule(nn.Sequential(nn.Conv1d(4, 4, 1), nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="overlap lists '0', a Conv1d"):
        sch.sync("bwd_post", "all_reduce", overlap=["0"])
    with pytest.raises(ValueError, match="bwd_post all_reduce only"):
        sch.sync("fwd_post", "all_reduce", overlap=["1"])
