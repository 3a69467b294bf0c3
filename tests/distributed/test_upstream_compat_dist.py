"""Upstream Slapo's spellings that need ranks, on 2 gloo ranks: ``Verify(..., device=)`` on a
model whose weights differ per rank (it runs from the first rank's) and on one created on the
meta device (initialised as build does), GPT-2's ``gen_embedding_hooks`` around a
vocabulary-sharded embedding, and ``decompose`` after a column-parallel shard (upstream's
schedules shard, then fuse bias+GeLU), each against the plain model; ``slapo.execute`` with
``slapo.env.setup``, as upstream's scripts launch ranks."""

import argparse
import copy
import os
import socket
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks
from torch import nn

import slapo


class TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear1, self.linear2 = nn.Linear(20, 30), nn.Linear(30, 40)

    def forward(self, x):
        return self.linear2(self.linear1(x))


def _shard(sch, reduce_output: bool):
    sch["linear1"].shard("weight", axis=0)
    sch["linear1"].shard("bias", axis=0)
    sch["linear1"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
    sch["linear2"].shard("weight", axis=1)
    if reduce_output:
        sch["linear2"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")


def _verify():
    results = {}
    torch.manual_seed(100 + torch.distributed.get_rank())  # weights differ per rank
    for meta in (False, True):
        with slapo.init_empty_weights(enable=meta):
            model = TwoLinears()
        for reduce_output in (True, False):
            sch = slapo.create_schedule(copy.deepcopy(model))
            x = torch.rand(10, 20)  # differs per rank too: Verify takes the first rank's
            try:
                with slapo.Verify(sch, [x], device="cpu"):
                    _shard(sch, reduce_output)
                results[meta, reduce_output] = "passed"
            except AssertionError as err:
                results[meta, reduce_output] = str(err)
        results[meta, "kept"] = not any(p.is_meta for p in sch.mod.parameters())
    return results


def test_verify_takes_a_device_and_models_on_the_meta_device():
    for results in run_ranks(_verify):
        for meta in (False, True):
            assert results[meta, True] == "passed", results[meta, True]
            assert "the output differs" in results[meta, False]
            assert results[meta, "kept"]


def _embedding():
    from slapo.model_schedule.gpt2 import gen_embedding_hooks

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Embedding(12, 6), nn.Linear(6, 3))
    sch = slapo.create_schedule(copy.deepcopy(plain))
    sch["0"].shard("weight", axis=0)
    pre, post = gen_embedding_hooks(sch, vocab_size=12)
    sch["0"].sync(mode="fwd_pre", sync_op_or_fn=pre)
    sch["0"].sync(mode="fwd_post", sync_op_or_fn=post)
    ids = torch.tensor([[0, 5, 6, 11], [3, 7, 2, 9]])
    out, expected = sch.mod(ids), plain(ids)
    out.sum().backward()
    expected.sum().backward()
    rank = torch.distributed.get_rank()
    return (torch.allclose(out, expected, atol=1e-6),
            torch.allclose(sch.mod[0].weight.grad, plain[0].weight.grad[6 * rank:6 * rank + 6]))


def test_gen_embedding_hooks_make_a_vocabulary_parallel_embedding():
    for same_output, same_grad in run_ranks(_embedding):
        assert same_output and same_grad


class MLP(nn.Module):
    def __init__(self, bias: bool):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32, bias=bias), nn.Linear(32, 16, bias=bias)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def _mlps():
    results = {}
    torch.manual_seed(0)
    x = torch.randn(2, 8, 16)
    # projections without bias (GPT-Neo's attention), Megatron's column/row split
    sch = slapo.create_schedule(MLP(bias=False))
    with slapo.Verify(sch, [x]):
        sch["fc1"].shard("weight", axis=0)
        sch["fc1"].sync("bwd_post", "all_reduce")
        sch["fc2"].shard("weight", axis=1)
        sch["fc2"].sync("fwd_post", "all_reduce")
    results["no bias"] = "passed"
    # upstream's resharding scheme on a model made on the meta device
    with slapo.init_empty_weights():
        model = MLP(bias=True)
    sch = slapo.create_schedule(model)
    with slapo.Verify(sch, [x], device="cpu"):
        sch["fc1"].shard("weight", axis=0)
        sch["fc1"].shard("bias", axis=0)
        sch["fc1"].sync("fwd_post", sync_op_or_fn="RS->SR")
        sch["fc1"].sync("fwd_post", sync_op_or_fn="SR->RS")
        sch["fc2"].shard("weight", axis=1)
        sch["fc2"].sync("fwd_post", sync_op_or_fn="all_reduce")
    results["meta reshard"] = "passed"
    return results


def test_mlps_without_bias_and_resharded_on_the_meta_device_train_as_plain():
    for results in run_ranks(_mlps):
        assert results == {"no bias": "passed", "meta reshard": "passed"}


class NormFFN(nn.Module):
    """A LayerNorm before the FFN: its gradients need fc1's input-gradient all-reduce."""

    def __init__(self):
        super().__init__()
        self.norm, self.fc1, self.act, self.fc2 = (nn.LayerNorm(8), nn.Linear(8, 16), nn.GELU(),
                                                   nn.Linear(16, 8))

    def forward(self, x):
        return self.fc2(self.act(self.fc1(self.norm(x))))


def _shard_ffn(sch, fc1_sync: bool = True):
    sch["fc1"].shard("weight", axis=0)
    sch["fc1"].shard("bias", axis=0)
    if fc1_sync:
        sch["fc1"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
    sch["fc2"].shard("weight", axis=1)
    sch["fc2"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")


def _decompose_after_shard():
    results = {}
    torch.manual_seed(0)
    model, x = NormFFN(), torch.randn(4, 8)
    for traced_first in (False, True):
        sch = slapo.create_schedule(copy.deepcopy(model))
        with slapo.Verify(sch, [x]):
            _shard_ffn(sch)
            if traced_first:  # this package's order: trace, then decompose in the graph
                sch.trace()
                sch["fc1"].decompose()
            else:  # upstream's: decompose, then trace(flatten=True) records the bias add
                sch["fc1"].decompose()
                sch.trace(flatten=True)
            found = sch.find(lambda x, bias: F.gelu(x + bias))
            results[traced_first, "found"] = len(found)
            sch.fuse(found[0], compiler=None, name="bias_gelu")
        results[traced_first] = (type(sch.mod.fc1).__name__, tuple(sch.mod.fc1.weight.shape))
    sch = slapo.create_schedule(copy.deepcopy(model))
    try:  # the control: without fc1's sync the LayerNorm's gradients are wrong
        with slapo.Verify(sch, [x]):
            _shard_ffn(sch, fc1_sync=False)
        results["no sync"] = "passed"
    except AssertionError as err:
        results["no sync"] = str(err)
    for refused in ("row parallel", "fwd_post"):
        sch = slapo.create_schedule(copy.deepcopy(model))
        if refused == "row parallel":
            _shard_ffn(sch)
            target = "fc2"
        else:
            sch["fc1"].shard("weight", axis=0)
            sch["fc1"].shard("bias", axis=0)
            sch["fc1"].sync(mode="fwd_post", sync_op_or_fn="all_gather", axis=1)
            target = "fc1"
        try:
            sch[target].decompose()
            results[refused] = "accepted"
        except ValueError as err:
            results[refused] = str(err)
    return results


def test_decompose_after_a_column_parallel_shard_trains_as_the_plain_model():
    for results in run_ranks(_decompose_after_shard):
        for traced_first in (False, True):
            assert results[traced_first, "found"] == 1
            assert results[traced_first] == ("DecomposedLinear", (8, 8))
        assert "norm.weight" in results["no sync"], results["no sync"]
        assert "row-parallel shard" in results["row parallel"]
        assert "forward hooks (a fwd_post sync)" in results["fwd_post"]


def _all_reduce_rank(rank, args):
    if args.fail:
        raise ValueError(f"rank {rank} failed on purpose")
    slapo.env.setup(rank, args.world_size)
    total = torch.tensor([float(rank + 1)])
    torch.distributed.all_reduce(total)
    (Path(args.folder) / f"rank{rank}").write_text(
        f"{total.item()} {torch.distributed.get_backend()}")
    slapo.env.cleanup()


def test_execute_runs_upstreams_launch_on_cpu_ranks(monkeypatch):
    with socket.socket() as free:
        free.bind(("localhost", 0))
        port = free.getsockname()[1]
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # gloo, whatever the machine has
    with tempfile.TemporaryDirectory() as folder:
        slapo.execute(_all_reduce_rank, argparse.Namespace(world_size=2, folder=folder,
                                                           fail=False))
        assert [(Path(folder) / f"rank{r}").read_text() for r in (0, 1)] == ["3.0 gloo"] * 2
    assert os.environ["MASTER_PORT"] == str(port)  # a port already set is kept
    with pytest.raises(Exception, match="failed on purpose"):
        slapo.execute(_all_reduce_rank, argparse.Namespace(world_size=2, folder="", fail=True))
