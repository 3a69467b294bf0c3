"""``compile(fuse_projections=True)``: the linears of a compiled region that read one input run
as one matrix product over their concatenated weights (``slapo.primitives._projections``).
Checked with Dynamo's ``eager`` backend (the rewritten graph runs as it is, no Inductor), fp32:
outputs and every gradient against the uncompiled module within 1e-6 relative (a wider product
sums in the same order per output; measured here: 0 to 2e-7). The families' compiled layers
with Inductor: ``tests/distributed/test_sched_compile.py``."""
from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
from torch import nn

import slapo
from slapo.primitives import _projections
from slapo_ae.harness.worker import fused_projection_note

TOL = 1e-6


class Block(nn.Module):
    """Three biased projections of one input (fused), two unbiased of another (fused apart),
    one unbiased beside the biased ones (alone: a group has a bias or none), and two whose
    outputs later ops write in place (alone: a split's slice cannot be written)."""

    def __init__(self, width=8):
        super().__init__()
        self.query, self.key, self.value = (nn.Linear(width, width) for _ in range(3))
        self.gate, self.up = (nn.Linear(width, 2 * width, bias=False) for _ in range(2))
        self.plain = nn.Linear(width, width, bias=False)
        self.scratch, self.other = (nn.Linear(width, width, bias=False) for _ in range(2))

    def forward(self, x):
        q, k, v = self.query(x), self.key(x), self.value(x)
        mixed = (q * k).softmax(-1) * v + self.plain(x)
        scratch, other = self.scratch(mixed), self.other(mixed)
        scratch.mul_(0.5)
        other += 1.0
        gated = (self.gate(mixed).sigmoid() * self.up(mixed)).sum(-1, keepdim=True)
        return gated + scratch * other


def _compiled(model, **kwargs):
    sch = slapo.create_schedule(model)
    sch.compile(backend="eager", dynamic=False, **kwargs)
    return slapo.build_module(sch)


def _relative(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-3)).item()


def test_projections_that_read_one_input_train_as_separate_linears():
    torch._dynamo.reset()
    torch.manual_seed(0)
    plain = Block()
    fused = _compiled(copy.deepcopy(plain), fuse_projections=True)
    before = len(_projections.fused_groups())
    x = torch.randn(2, 5, 8)  # [batch, seq, hidden]: the 3-D inputs of transformer layers
    weights = torch.randn(2, 5, 8)
    expected, got = plain(x), fused(x)
    (expected * weights).sum().backward()
    (got * weights).sum().backward()
    assert _relative(got, expected) < TOL
    for (name, p), (_, q) in zip(plain.named_parameters(), fused.named_parameters()):
        assert q.shape == p.shape, name  # the parameters keep their shape and place
        assert _relative(q.grad, p.grad) < TOL, name
    assert _projections.fused_groups()[before:] == [("query", "key", "value"),
                                                    ("gate", "up")]
    torch._dynamo.reset()


def test_a_graph_with_nothing_to_fuse_is_left_as_it_is():
    layer = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    gm = torch.fx.symbolic_trace(lambda x: torch.nn.functional.linear(x, torch.ones(4, 4)))
    assert _projections.fuse_projections(gm) == []  # a weight that is no graph input
    traced = torch.fx.symbolic_trace(layer)
    assert _projections.fuse_projections(traced) == []  # module calls: one linear an input


def test_fuse_projections_takes_no_mode_or_options():
    sch = slapo.create_schedule(Block())
    with pytest.raises(ValueError, match="fuse_projections .* no mode or options"):
        sch.compile(mode="max-autotune", fuse_projections=True)
    assert not slapo.state.is_compiled(sch.mod)


def test_the_record_notes_each_group_once_with_its_common_path():
    groups = [("attention.self.query", "attention.self.key", "attention.self.value"),
              ("mlp.gate_proj", "mlp.up_proj"),
              ("attention.self.query", "attention.self.key", "attention.self.value"),
              ("layer.0.k", "layer.1.v")]
    line = _projections.describe(groups)
    assert line.endswith(": attention.self.query+key+value, mlp.gate_proj+up_proj, "
                         "layer.0.k+layer.1.v")


def test_the_harness_notes_what_this_process_fused(monkeypatch):
    monkeypatch.setattr(_projections, "_FUSED", [])
    assert fused_projection_note() is None
    monkeypatch.setattr(_projections, "_FUSED", [("self_attn.q_proj", "self_attn.k_proj")])
    assert fused_projection_note().endswith("self_attn.q_proj+k_proj")
