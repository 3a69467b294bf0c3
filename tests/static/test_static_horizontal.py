"""Horizontal fusion: several matches of ``find`` given together to ``replace``,
``checkpoint`` or ``fuse`` become one call side by side (upstream Slapo's list of matches):
three projections of one input replaced by one module returning the three, the same model
afterwards; checkpointed together, the same gradients; and unions that cannot be one call
refused."""

import copy

import pytest
import torch
import torch.fx as fx
from static_models import Together
from torch import nn

import slapo


class QKV(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(6, 4), nn.Linear(6, 4), nn.Linear(6, 4)
        self.out = nn.Linear(4, 6)

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        return self.out(torch.softmax(q * k, dim=-1) * v)


def _calls(sch):
    return {n.name: n for n in sch.mod.graph.nodes if n.op == "call_module"}


def _traced_copy():
    """A seeded QKV, and a traced schedule of its copy with the graph's module calls."""
    torch.manual_seed(0)
    plain = QKV()
    sch = slapo.create_schedule(copy.deepcopy(plain))
    sch.trace()
    return plain, sch, _calls(sch)


def test_three_matches_replaced_by_one_call():
    plain, sch, calls = _traced_copy()
    parts = [[calls["q"]], [calls["k"]], [calls["v"]]]
    sch.replace(Together(sch.mod.q, sch.mod.k, sch.mod.v), subgraph=parts, name="qkv")
    calls = _calls(sch)
    assert "qkv_0" in calls and not {"q", "k", "v"} & set(calls)
    assert [a.name for a in calls["qkv_0"].args] == ["x"]  # the shared input, once
    x = torch.randn(3, 6)
    torch.testing.assert_close(sch.mod(x), plain(x), rtol=0, atol=0)
    assert {n for n, _ in sch.mod.named_parameters()} == {n for n, _ in plain.named_parameters()}


def test_matches_checkpointed_together_keep_the_gradients():
    plain, sch, calls = _traced_copy()
    sch.checkpoint(subgraph=[[calls["q"]], [calls["k"]], [calls["v"]]], name="projections")
    assert isinstance(sch["projections_0"].mod, fx.GraphModule)
    x = torch.randn(3, 6)
    for model in (plain, sch.mod):
        model(x).square().sum().backward()
    for (name, p), (_, s) in zip(plain.named_parameters(), sch.mod.named_parameters()):
        torch.testing.assert_close(s.grad, p.grad, msg=name)


def test_unions_that_cannot_be_one_call_are_refused():
    sch = slapo.create_schedule(QKV())
    sch.trace()
    calls = _calls(sch)
    with pytest.raises(ValueError, match="overlap"):
        sch.replace(nn.Identity(), subgraph=[[calls["q"]], [calls["q"]]])
    # 'out' reads the softmax, which reads q: q and out together would enclose the softmax
    with pytest.raises(ValueError, match="not convex"):
        sch.replace(nn.Identity(), subgraph=[[calls["q"]], [calls["out"]]])
    with pytest.raises(ValueError, match=r"side by side as a list of subgraphs"):
        sch.replace(nn.Identity(), subgraph=[calls["q"], calls["k"]])
