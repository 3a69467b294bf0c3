"""Upstream Slapo's spellings that need ranks, on 2 gloo ranks: ``Verify(..., device=)`` on a
model whose weights differ per rank (it runs from the first rank's) and on one created on the
meta device (initialised as build does), and GPT-2's ``gen_embedding_hooks`` around a
vocabulary-sharded embedding, each against the plain model."""

import copy

import torch
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
