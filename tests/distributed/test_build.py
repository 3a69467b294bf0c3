"""slapo.build with upstream Slapo's contract, on 2 gloo ranks: ``(model, optimizer)``;
``init_weights=True`` or a function initialises sharded parameters at their full shape, so the
sharded model starts as the unsharded one (padding row, ties and shard specs included), on
meta models too; ``target="deepspeed"`` gives DeepSpeed's engine, which trains."""

import copy
import os

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from torch import nn

import slapo
from slapo.build import initialize
from slapo.sharding import gather_sharded


class Net(nn.Module):
    """A vocabulary-parallel embedding with a padding row, tied to the output head; a
    column- and a row-parallel linear; a replicated linear and a norm."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8, padding_idx=13)  # row 13 lives on rank 1
        self.up = nn.Linear(8, 12)
        self.down = nn.Linear(12, 8)
        self.mix = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        h = self.norm(self.mix(self.down(torch.relu(self.up(self.embed(ids))))))
        return self.head(h)


def _schedule(model):
    sch = slapo.create_schedule(model)
    sch["embed"].shard("weight", axis=0)
    sch["embed"].sync("fwd_post", "all_reduce")
    sch["up"].shard("weight", axis=0)
    sch["up"].sync("bwd_post", "all_reduce")
    sch["down"].shard("weight", axis=1)
    sch["down"].sync("fwd_post", "all_reduce")
    sch["head"].sync("fwd_post", "all_gather", axis=-1, tensor_parallel_output_grad=False)
    return sch


def _full(model) -> dict:
    """Every parameter at full shape (sharded ones gathered)."""
    out = {}
    for name, param in model.named_parameters():
        spec = slapo.shard_spec(param)
        out[name] = gather_sharded(param, spec.axis) if spec else param.detach().clone()
    return out


def _reference(seed: int) -> dict:
    """The unsharded model initialised the same way (no group: nothing to slice)."""
    torch.manual_seed(seed)
    plain = Net()
    torch.manual_seed(seed)
    initialize(plain, True, broadcast=False)
    return {k: v.detach().clone() for k, v in plain.named_parameters()}


def _run_init():
    rank = dist.get_rank()
    results = {}
    # a different seed per rank: the broadcast makes the ranks agree anyway
    torch.manual_seed(0)
    sch = _schedule(Net())
    torch.manual_seed(11 + 100 * rank)
    model, optimizer = slapo.build(sch, init_weights=True)
    results["true"] = (_full(model), optimizer, model.head.weight is model.embed.weight,
                       tuple(model.up.weight.shape))

    with slapo.init_empty_weights():
        meta_model = Net()
    sch = _schedule(meta_model)
    torch.manual_seed(11 + 100 * rank)
    model, _ = slapo.build(sch, init_weights=True, device="cpu")
    results["meta"] = _full(model)

    visited = []

    def init(module, path):
        visited.append(path)
        for param in module.parameters(recurse=False):
            param.copy_(torch.arange(param.numel(), dtype=param.dtype).view(param.shape))

    model, _ = slapo.build(_schedule(Net()), init_weights=init)
    results["fn"] = (_full(model), visited)

    model = Net()
    kept = copy.deepcopy(model.state_dict())
    built = slapo.build_module(_schedule(model))  # the weights stay as they are
    results["kept"] = (_full(built)["mix.weight"], kept["mix.weight"])
    return results


def test_init_weights_initialise_sharded_parameters_as_the_unsharded_model():
    reference = _reference(11 + 100 * 0)  # rank 0's seed: the values it broadcast
    by_rank = run_ranks(_run_init)
    for results in by_rank:
        full, optimizer, tied, up_shape = results["true"]
        assert optimizer is None and tied and up_shape == (6, 8)
        assert full.keys() == reference.keys()
        for name, value in reference.items():
            torch.testing.assert_close(full[name], value, rtol=0, atol=0, msg=name)
            torch.testing.assert_close(results["meta"][name], value, rtol=0, atol=0, msg=name)
        assert torch.all(full["embed.weight"][13] == 0)  # the padding row, held by rank 1

        full_fn, visited = results["fn"]
        assert visited == ["embed", "up", "down", "mix", "norm"]  # apply order, ties once
        assert torch.equal(full_fn["up.weight"], torch.arange(96.0).view(12, 8))
        assert torch.equal(full_fn["down.weight"], torch.arange(96.0).view(8, 12))

        mixed, kept = results["kept"]
        assert torch.equal(mixed, kept)


def _run_hf():
    from slapo.model_schedule import schedule_model
    from slapo_ae.zoo import build_model

    sch = slapo.create_schedule(build_model("bert-tiny"))
    schedule_model(sch)  # kernels, TP of attention, FFN and the vocabulary (padding row 0)
    torch.manual_seed(5)
    model, _ = slapo.build(sch)  # init_weights=True: transformers' _init_weights
    return _full(model)


def test_an_hf_model_sharded_starts_as_unsharded():
    from slapo_ae.zoo import build_model

    plain = build_model("bert-tiny")
    torch.manual_seed(5)
    initialize(plain, True, broadcast=False)
    expected = dict(plain.named_parameters())
    for full in run_ranks(_run_hf):
        assert full.keys() == expected.keys()
        for name, value in full.items():
            torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=name)
        assert torch.all(full["bert.embeddings.word_embeddings.weight"][0] == 0)


def test_build_refuses_unknown_targets_and_options():
    sch = slapo.create_schedule(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="unknown build target 'megatron'"):
        slapo.build(sch, target="megatron")
    with pytest.raises(ValueError, match="unexpected options for target None: config"):
        slapo.build(sch, init_weights=False, config={})
    with pytest.raises(ValueError, match="needs config="):
        slapo.build(sch, target="deepspeed", init_weights=False)


def _run_deepspeed():
    import deepspeed

    from slapo_ae.harness.systems.deepspeed_zero3 import quiet_deepspeed

    quiet_deepspeed("cpu")  # no shared-memory op to compile on CPU (see the harness)
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))  # what torchrun would set
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 1))
    sch = slapo.create_schedule(copy.deepcopy(plain))
    sch["0"].checkpoint()
    config = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
              "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 1 << 30}
    optimizer = torch.optim.SGD(sch.mod.parameters(), lr=0.1)
    engine, opt = slapo.build(sch, target="deepspeed", init_weights=False, config=config,
                              optimizer=optimizer)
    x = torch.randn(2, 6, generator=torch.Generator().manual_seed(dist.get_rank()))
    losses = []
    for _ in range(2):
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    first_plain = plain(x).pow(2).mean().item()
    return isinstance(engine, deepspeed.DeepSpeedEngine), opt is not None, losses, first_plain


@pytest.mark.slow
def test_deepspeed_target_gives_an_engine_that_trains():
    for is_engine, has_optimizer, losses, first_plain in run_ranks(_run_deepspeed):
        assert is_engine and has_optimizer
        assert abs(losses[0] - first_plain) <= 1e-5 * max(1.0, abs(first_plain))
        assert losses[1] < losses[0]  # one SGD step on the same batch lowers its loss
