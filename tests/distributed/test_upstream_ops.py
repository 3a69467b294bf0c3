"""slapo.op's modules under upstream Slapo's names, alone and sharded over 2 gloo ranks:
FusedQKV split by heads, LinearWithSyncFunc row-parallel with its own sync, FusedMLP, and
ParallelCrossEntropy on vocabulary-sharded logits; each against the plain computation."""

import copy

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks
from torch import nn

import slapo
from slapo.op import (
    FusedMLP,
    FusedQKV,
    LinearWithAct,
    LinearWithDropout,
    LinearWithSeparateBias,
    LinearWithSyncFunc,
    ParallelCrossEntropy,
)
from slapo.sharding import all_reduce_forward, gather_sharded, shard_slice

TOL = 1e-5


def test_single_process_forms():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8)
    plain = nn.Linear(8, 6)
    separate = LinearWithSeparateBias(8, 6)
    separate.load_state_dict(plain.state_dict())
    torch.testing.assert_close(separate(x), plain(x))
    synced = LinearWithSyncFunc(8, 6, sync_fn=lambda y: 2 * y)
    synced.load_state_dict(plain.state_dict())
    torch.testing.assert_close(synced(x), 2 * F.linear(x, plain.weight) + plain.bias)

    qkv = FusedQKV(8, num_heads=2, world_size=1)
    q, k, v = qkv(x)
    assert q.shape == k.shape == v.shape == (2, 5, 2, 4)
    rows = qkv.fused_linear(x).view(2, 5, 2, 4, 3)  # per head feature: q, k, v
    assert torch.equal(q, rows[..., 0]) and torch.equal(v, rows[..., 2])

    # upstream's last layout: fc_in a LinearWithAct, fc_out a LinearWithDropout, both biased
    mlp = FusedMLP(8, 16, "gelu_new", resid_pdrop=0.0)
    expected = F.linear(F.gelu(F.linear(x, mlp.fc_in.weight, mlp.fc_in.bias),
                               approximate="tanh"), mlp.fc_out.weight, mlp.fc_out.bias)
    torch.testing.assert_close(mlp(x), expected)
    assert {n for n, _ in mlp.named_parameters()} == {"fc_in.weight", "fc_in.bias",
                                                       "fc_out.weight", "fc_out.bias"}
    assert isinstance(mlp.fc_in, LinearWithAct) and isinstance(mlp.fc_out, LinearWithDropout)
    with pytest.raises(NotImplementedError, match="unsupported activation 'relu'"):
        FusedMLP(8, 16, "relu", 0.0)
    with pytest.raises(ValueError, match="LinearWithDropout needs a bias"):
        LinearWithDropout(8, 6, bias=False)
    dropped = LinearWithDropout(8, 6, p=0.5, sync_fn=lambda y: 2 * y)
    torch.manual_seed(1)
    got = dropped(x)
    torch.manual_seed(1)
    torch.testing.assert_close(got, F.dropout(2 * F.linear(x, dropped.weight) + dropped.bias,
                                              0.5))

    logits, labels = torch.randn(3, 7), torch.tensor([1, 6, 0])
    torch.testing.assert_close(ParallelCrossEntropy()(logits, labels),
                               F.cross_entropy(logits, labels, reduction="none"))


def _run_sharded():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8)
    results = {}

    qkv = FusedQKV(8, num_heads=2, world_size=1)
    sharded = copy.deepcopy(qkv)
    sharded.world_size = 2
    sch = slapo.create_schedule(sharded)
    sch["fused_linear"].shard(["weight", "bias"], axis=0)  # whole heads of q, k and v
    full = qkv(x)
    results["qkv"] = [float((gather_sharded(mine, -2) - ref).abs().max())
                      for mine, ref in zip(sharded(x), full)]

    row = LinearWithSyncFunc(8, 6, sync_fn=all_reduce_forward)
    plain = nn.Linear(8, 6)
    plain.load_state_dict(row.state_dict())
    sch = slapo.create_schedule(row)
    sch.shard("weight", axis=1)  # its own forward: partial sums reduced, then the bias
    out = row(shard_slice(x, -1, None))
    results["row"] = float((out - plain(x)).abs().max())

    # upstream's last GPT-Neo MLP sharding (its gpt_neo.py): the fused projections with
    # biases, fc_out row-parallel with a fwd_post all-reduce, which runs before its bias and
    # dropout (its sync_fn, as upstream set it), not after them: the bias is added once
    mlp = FusedMLP(8, 16, "gelu", resid_pdrop=0.0)
    with torch.no_grad():
        mlp.fc_in.bias.uniform_(-1, 1), mlp.fc_out.bias.uniform_(-1, 1)
    plain = copy.deepcopy(mlp)
    sch = slapo.create_schedule(mlp)
    sch["fc_in"].shard(["weight", "bias"], axis=0)
    sch["fc_in"].sync("bwd_post", "all_reduce")
    sch["fc_out"].shard("weight", axis=1)
    sch["fc_out"].sync("fwd_post", "all_reduce")
    xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, ref = mlp(xs[0]), plain(xs[1])
    (out * ref.detach()).sum().backward(), (ref * ref.detach()).sum().backward()
    results["mlp"] = [float((out - ref).abs().max()), float((xs[0].grad - xs[1].grad).abs().max()),
                      float((mlp.fc_out.bias.grad - plain.fc_out.bias.grad).abs().max())]
    with pytest.raises(ValueError, match="already has a sync_fn"):
        sch["fc_out"].sync("fwd_post", "all_reduce")

    logits, labels = torch.randn(4, 16), torch.tensor([0, 15, 7, 8])
    mine = ParallelCrossEntropy()(shard_slice(logits, -1, None), labels)
    results["ce"] = float((mine - F.cross_entropy(logits, labels, reduction="none")).abs().max())
    return results


def test_sharded_forms_compute_the_plain_results():
    for results in run_ranks(_run_sharded):
        assert max(results["qkv"]) <= TOL
        assert results["row"] <= TOL
        assert max(results["mlp"]) <= TOL
        assert results["ce"] <= TOL
