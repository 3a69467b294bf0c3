"""Upstream Slapo's spellings: init_empty_weights, set_random_seed,
get_cuda_rng_tracker, the function form slapo.checkpoint, Schedule.get_module."""

import random

import numpy as np
import pytest
import torch
from torch import nn

import slapo
from slapo.random import STREAM_SEED_OFFSET, rng_streams


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.norm = nn.BatchNorm1d(6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.drop = nn.Dropout(0.5)

    def forward(self, ids):
        return self.head(self.drop(self.norm(self.embed(ids).transpose(1, 2)).transpose(1, 2)))


def test_init_empty_weights_puts_parameters_on_meta_and_build_gives_them_storage():
    with slapo.init_empty_weights():
        model = Net()
    assert all(p.is_meta for p in model.parameters())
    assert not model.norm.running_mean.is_meta  # buffers stay unless include_buffers
    assert model.head.weight is model.embed.weight
    assert not nn.Linear(2, 2).weight.is_meta  # only inside the block

    sch = slapo.create_schedule(model)
    sch["head"].annotate("weight", "kind", "tied")

    def init(mod):
        if isinstance(mod, nn.Embedding):
            mod.weight.fill_(0.5)
        elif isinstance(mod, nn.BatchNorm1d):
            mod.reset_parameters()

    built = slapo.build_module(sch, init_weights=init)
    assert not any(p.is_meta for p in built.parameters())
    assert built.head.weight is built.embed.weight
    assert torch.all(built.embed.weight == 0.5)
    assert slapo.get_annotations(built.head.weight) == {"kind": "tied"}


def test_init_empty_weights_with_buffers_and_disabled():
    with slapo.init_empty_weights(include_buffers=True):
        model = Net()
    assert model.norm.running_mean.is_meta and model.embed.weight.is_meta
    with slapo.init_empty_weights(enable=False):
        model = Net()
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def _draws():
    return random.random(), float(np.random.rand()), torch.rand(3)


def test_set_random_seed_seeds_every_generator_by_rank():
    assert slapo.set_random_seed(7) == 7
    first = _draws()
    slapo.set_random_seed(7)
    again = _draws()
    assert first[:2] == again[:2] and torch.equal(first[2], again[2])
    assert slapo.set_random_seed(7, dp_rank=1, pp_rank=2) == 7 + 10 + 200
    assert torch.initial_seed() == 217


def test_set_random_seed_creates_the_tensor_parallel_stream():
    tracker = slapo.get_cuda_rng_tracker()
    assert tracker is rng_streams()
    tracker.reset()
    with pytest.raises(RuntimeError, match="set_random_seed"):
        with tracker.fork():
            pass

    draws = []
    for tp_rank in (0, 1, 0):
        slapo.set_random_seed(5, tp_rank=tp_rank)
        outside = torch.rand(2)
        with tracker.fork("tensor_parallel"):  # another name of the same stream
            inside = torch.rand(2)
        draws.append((outside, inside, torch.rand(2)))
        assert list(tracker.get_states()) == ["model-parallel-rng"]  # upstream's name
    (out0, in0, after0), (out1, in1, after1), (out0b, in0b, _) = draws
    assert torch.equal(out0, out1)      # replicated regions agree across TP ranks
    assert not torch.equal(in0, in1)    # sharded regions draw per rank
    assert torch.equal(in0, in0b)       # reproducibly
    stream = torch.Generator().manual_seed(5 + STREAM_SEED_OFFSET)  # seed + 2718 + tp_rank
    assert torch.equal(in0, torch.rand(2, generator=stream))
    # the default generator continues as if the fork had not happened
    torch.manual_seed(5)
    torch.rand(2)
    assert torch.equal(after0, torch.rand(2))


def test_checkpoint_function_gives_the_same_gradients_with_dropout():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.GELU(), nn.Linear(8, 4))
    x = torch.randn(3, 4, requires_grad=True)
    grads = []
    for use_checkpoint in (False, True):
        torch.manual_seed(1)
        block.zero_grad()
        x.grad = None
        out = slapo.checkpoint(block, x) if use_checkpoint else block(x)
        out.square().sum().backward()
        grads.append([x.grad.clone(), *[p.grad.clone() for p in block.parameters()]])
    for plain, checkpointed in zip(*grads):
        assert torch.equal(plain, checkpointed)

    def fn(a, scale=1.0):  # a plain function, keyword arguments pass through
        return torch.sin(a) * scale
    y = slapo.checkpoint(fn, x, scale=2.0)
    assert torch.equal(y, torch.sin(x) * 2.0)
    with torch.no_grad():
        assert torch.equal(slapo.checkpoint(fn, x), torch.sin(x))


def test_get_module_is_the_node_module():
    sch = slapo.create_schedule(Net())
    assert sch.get_module("head") is sch["head"].mod
    with pytest.raises(KeyError, match="closest existing paths"):
        sch.get_module("haed")
