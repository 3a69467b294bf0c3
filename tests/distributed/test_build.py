"""slapo.build with upstream Slapo's contract, on 2 gloo ranks: ``(model, optimizer)``;
``init_weights=True`` or a function initialises sharded parameters at their full shape, so the
sharded model starts as the unsharded one (padding row, ties and shard specs included), on
meta models too; ``target="deepspeed"`` gives DeepSpeed's engine, which trains."""

import copy
import math
import os
import warnings

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

    _start_zero3_rank()
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


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down, self.norm = nn.Linear(6, 12), nn.Linear(12, 6), nn.LayerNorm(6)

    def forward(self, x):
        return self.norm(x + self.down(torch.nn.functional.gelu(self.up(x))))


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.tokens, self.norm = nn.Embedding(10, 6), nn.LayerNorm(6)

    def forward(self, ids):
        return self.norm(self.tokens(ids))


ZERO3 = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
         "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True,
         "steps_per_print": 1 << 30}


def test_zero3_leaves_are_the_compiled_regions_that_can_be_leaves():
    """Under ZeRO-3 the build names each compiled region a leaf module, except one that holds
    an embedding or shares a weight with a module outside it (each with its reason)."""
    from slapo.engines import compiled_regions, with_zero3_leaves, zero3_leaves

    head = nn.Linear(6, 10, bias=False)
    model = nn.Sequential(Embed(), Block(), nn.Sequential(Block(), Block()), head)
    sch = slapo.create_schedule(model)
    for name in ("0", "1", "2", "2.0", "3"):
        sch[name].compile()
    model[0].tokens.weight = head.weight  # tied: the head's weight is the embedding's
    assert compiled_regions(model) == ["0", "1", "2", "3"]  # the outermost regions
    leaves, refused = zero3_leaves(model)
    assert leaves == ["1", "2"] and list(refused) == ["0", "3"]
    assert "it holds an embedding" in refused["0"]
    assert refused["3"].startswith("it shares a parameter with '0.tokens' (tied weights)")
    config = {"zero_optimization": {"stage": 3, "leaf_module": {"names": ["x"]}}}
    assert with_zero3_leaves(model, config)["zero_optimization"]["leaf_module"] == {
        "names": ["x", "1", "2"]}
    assert config["zero_optimization"]["leaf_module"] == {"names": ["x"]}  # not changed
    stage2 = {"zero_optimization": {"stage": 2}}
    assert with_zero3_leaves(model, stage2) is stage2
    plain = nn.Sequential(Block())
    assert with_zero3_leaves(plain, ZERO3) is ZERO3  # nothing compiled


def test_the_build_keeps_torch_linear_in_compiled_regions_under_zero3(monkeypatch):
    """DeepSpeed's memory-efficient linear, which ZeRO-3 puts in place of torch's, left the
    biased Linear layers of compiled regions without gradients with torch 2.11: the build turns it
    off where the model has compiled regions, and warns where the config turns it on itself
    (DeepSpeed itself stubbed here)."""
    import deepspeed

    from slapo.engines import deepspeed_engine, with_torch_linear

    handed = []
    monkeypatch.setattr(deepspeed, "initialize", lambda **kw: (handed.append(kw["config"]) or
                                                              ("engine", "opt", None, None)))
    sch = slapo.create_schedule(nn.Sequential(Block()))
    assert with_torch_linear(sch.mod, ZERO3) is ZERO3  # nothing compiled
    sch["0"].compile()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert deepspeed_engine(sch.mod, config=ZERO3) == ("engine", "opt")
    assert handed[0]["zero_optimization"]["memory_efficient_linear"] is False
    assert handed[0]["zero_optimization"]["leaf_module"] == {"names": ["0"]}
    assert "memory_efficient_linear" not in ZERO3["zero_optimization"]  # not changed
    stage2 = {"zero_optimization": {"stage": 2}}
    assert with_torch_linear(sch.mod, stage2) is stage2
    own = {"zero_optimization": {"stage": 3, "memory_efficient_linear": True}}
    with pytest.warns(UserWarning, match="memory_efficient_linear is on with compiled regions"):
        deepspeed_engine(sch.mod, config=own)
    assert handed[1]["zero_optimization"]["memory_efficient_linear"] is True


def _start_zero3_rank():
    """What each rank of the ZeRO-3 tests below does first."""
    from slapo_ae.harness.systems.deepspeed_zero3 import quiet_deepspeed

    quiet_deepspeed("cpu")  # no shared-memory op to compile on CPU (see the harness)
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))  # what torchrun would set
    torch._dynamo.reset()
    torch.manual_seed(0)


def _zero3_steps(engine, inputs, loss_of) -> tuple[list[float], list[str]]:
    """One ZeRO-3 step per input; returns the losses and the engine's leaf modules."""
    losses = []
    for x in inputs:
        loss = loss_of(engine, x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    leaves = [n for n, m in engine.module.named_modules() if getattr(m, "_z3_leaf", False)]
    return losses, leaves


def _zero3_train(compiled: bool, leaves: bool):
    """Three ZeRO-3 steps of an embedding and two blocks, the first block checkpointed, each
    compiled by ``compile`` into a graph-counting backend or not; returns the losses, the
    graphs compiled per region and the leaf modules."""
    import slapo.engines

    _start_zero3_rank()
    sch = slapo.create_schedule(nn.Sequential(Embed(), Block(), Block()))
    graphs = {"0": 0, "1": 0, "2": 0}

    def counting(name):
        def backend(gm, example_inputs):
            graphs[name] += 1
            return gm.forward
        return backend

    if compiled:
        for name in graphs:
            sch[name].compile(backend=counting(name))
    sch["1"].checkpoint()
    if not leaves:  # what the build did before: ZeRO-3's hooks on every module
        slapo.engines.with_zero3_leaves = lambda model, config, layers=False: config
    optimizer = torch.optim.SGD(sch.mod.parameters(), lr=0.1)
    engine, _ = slapo.build(sch, target="deepspeed", init_weights=False, config=ZERO3,
                            optimizer=optimizer)
    ids = torch.randint(0, 10, (2, 3), generator=torch.Generator().manual_seed(dist.get_rank()))
    losses, leaf_names = _zero3_steps(engine, [ids] * 3, lambda e, x: e(x).pow(2).mean())
    return losses, graphs, leaf_names


@pytest.mark.slow
def test_compiled_regions_train_under_zero3_as_leaf_modules():
    """Under ZeRO-3 each compiled block is a leaf module: one graph per block (ZeRO-3's hooks
    run around it, not inside), and the losses of the uncompiled schedule, checkpoint
    included. The embedding's region keeps ZeRO-3's hooks, and trains right too. Without the
    leaves Dynamo meets the hooks inside the blocks. (With DeepSpeed's memory-efficient linear
    in the blocks, torch 2.11 gave their biased Linear layers no gradients and the losses were off
    from the second step: slapo.engines.with_torch_linear.)"""
    eager = run_ranks(_zero3_train, False, True)
    compiled = run_ranks(_zero3_train, True, True)
    hooked = run_ranks(_zero3_train, True, False)
    for rank in range(2):
        assert eager[rank][1] == {"0": 0, "1": 0, "2": 0} and eager[rank][2] == []
        losses, graphs, leaves = compiled[rank]
        assert leaves == ["1", "2"] and graphs["1"] == graphs["2"] == 1
        assert losses == pytest.approx(eager[rank][0], rel=1e-6, abs=1e-7)
        assert losses[2] < losses[0]
        assert hooked[rank][2] == [] and hooked[rank][1]["1"] > 1
        assert hooked[rank][0] == pytest.approx(eager[rank][0], rel=1e-6, abs=1e-7)


def test_transformer_layers_can_be_zero3_leaves_but_embeddings_cannot():
    from slapo.engines import layer_regions, with_zero3_leaves, zero3_leaves
    from slapo_ae.zoo import build_model

    model = build_model("bert-tiny")
    layers = ["bert.encoder.layer.0", "bert.encoder.layer.1"]
    assert layer_regions(model) == ["bert.embeddings", *layers]  # HF's _no_split_modules
    assert zero3_leaves(model) == ([], {})  # nothing compiled
    leaves, refused = zero3_leaves(model, layers=True)
    assert leaves == layers and list(refused) == ["bert.embeddings"]
    assert with_zero3_leaves(model, ZERO3, layers=True)["zero_optimization"]["leaf_module"] == {
        "names": layers}
    assert layer_regions(nn.Sequential(Block())) == []  # not a transformers model


def _albert_zero3(compiled: bool):
    """Three ZeRO-3 steps of a tiny AlbertForMaskedLM (3 layers sharing one layer's weights)
    under its kernel schedule, the shared layer compiled or not, 2 of its 3 calls checkpointed;
    returns the losses and the leaf modules."""
    from transformers import AlbertConfig, AlbertForMaskedLM

    from slapo.model_schedule import apply_schedule

    _start_zero3_rank()
    config = AlbertConfig(vocab_size=64, embedding_size=8, hidden_size=16, num_hidden_layers=3,
                          num_attention_heads=2, intermediate_size=32,
                          max_position_embeddings=16, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0)
    sch = apply_schedule(AlbertForMaskedLM(config), config, tensor_parallel=False,
                         ckpt_ratio=0.5, device="cpu", compile_layers=compiled)
    optimizer = torch.optim.SGD(sch.mod.parameters(), lr=0.1)
    engine, _ = slapo.build(sch, target="deepspeed", init_weights=False, config=ZERO3,
                            optimizer=optimizer)
    ids = [torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(
        10 * step + dist.get_rank())) for step in range(3)]
    return _zero3_steps(engine, ids, lambda e, x: e(input_ids=x, labels=x).loss)


@pytest.mark.slow
def test_a_compiled_shared_layer_trains_under_zero3_as_no_leaf():
    """ALBERT's shared layer, compiled, is no ZeRO-3 leaf module: it runs once for each layer
    of the model, and ZeRO-3 reduces a leaf's gradients when each call's backward ends
    (DeepSpeed 0.19.8 asserted on the repeated parameters: the default CUDA path of upstream's
    ALBERT example). With ZeRO-3's hooks on its modules it gives the uncompiled losses (1e-4:
    Inductor reassociates fp32 sums)."""
    from slapo.engines import zero3_leaves

    eager = run_ranks(_albert_zero3, False)
    compiled = run_ranks(_albert_zero3, True)
    for rank in range(2):
        assert eager[rank][1] == [] and compiled[rank][1] == []
        assert compiled[rank][0] == pytest.approx(eager[rank][0], rel=1e-4)
        assert compiled[rank][0][2] < compiled[rank][0][0]
    from transformers import AlbertConfig, AlbertModel

    from slapo.model_schedule import apply_schedule

    config = AlbertConfig(vocab_size=64, embedding_size=8, hidden_size=16, num_hidden_layers=4,
                          num_hidden_groups=2, num_attention_heads=2, intermediate_size=32)
    sch = apply_schedule(AlbertModel(config), config, device="cpu", compile_layers=True)
    leaves, refused = zero3_leaves(sch.mod)
    assert leaves == [] and list(refused) == [
        f"encoder.albert_layer_groups.{g}.albert_layers.0" for g in range(2)]
    assert all(why.startswith("it runs 2 times a forward (its weights are shared)")
               for why in refused.values())


def _zero3_schedule(model_name: str, compiled: bool, layer_leaves: bool = False):
    """Three ZeRO-3 steps of a tiny model under its kernel schedule on one rank's slice of a
    batch, its layers compiled (Inductor on CPU, the CUDA path) or not, its layers ZeRO-3
    leaf modules or not; returns the losses and the leaf modules."""
    from slapo.model_schedule import schedule_model
    from slapo_ae.zoo import build_model, no_dropout, synthetic_batch

    _start_zero3_rank()
    model = build_model(model_name, **no_dropout(model_name))
    sch = slapo.create_schedule(model)
    schedule_model(sch, tensor_parallel=False, kernel_opt=True, ckpt_ratio=0.5, device="cpu",
                   compile_layers=compiled)
    optimizer = torch.optim.SGD(sch.mod.parameters(), lr=0.1)
    engine, _ = slapo.build(sch, target="deepspeed", init_weights=False, config=ZERO3,
                            optimizer=optimizer, zero3_layer_leaves=layer_leaves)
    batches = [synthetic_batch(model.config, 2, 16, 8, seed=10 * step + dist.get_rank())
               for step in range(3)]
    return _zero3_steps(engine, batches, lambda e, batch: e(**batch).loss)


@pytest.mark.slow
@pytest.mark.parametrize("model_name", ["bert-tiny", "llama-tiny", "opt-tiny", "gpt-neo-tiny"])
def test_kernel_schedules_with_compiled_layers_train_under_zero3(model_name):
    """Slapo-ZeRO3's CUDA path on CPU ranks: the family schedule's compiled layers (half of
    them checkpointed), its compiled loss and, for BERT, its MLM head transform, as ZeRO-3
    leaf modules, give the losses of the uncompiled schedule to 1e-4 (Inductor reassociates
    fp32 sums). With DeepSpeed's memory-efficient linear in the compiled layers, torch 2.11
    failed this for the families whose Linear layers have biases (all but LLaMA)."""
    eager = run_ranks(_zero3_schedule, model_name, False)
    compiled = run_ranks(_zero3_schedule, model_name, True)
    layers = {"bert-tiny": ["bert.encoder.layer.0", "bert.encoder.layer.1",
                            "cls.predictions.transform"],
              "llama-tiny": ["model.layers.0", "model.layers.1"],
              "opt-tiny": ["model.decoder.layers.0", "model.decoder.layers.1"],
              "gpt-neo-tiny": ["transformer.h.0", "transformer.h.1"]}[model_name]
    for rank in range(2):
        assert eager[rank][1] == [] and compiled[rank][1] == layers
        assert compiled[rank][0] == pytest.approx(eager[rank][0], rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("model_name", ["bert-tiny", "llama-tiny", "t5-tiny"])
def test_uncompiled_layers_as_zero3_leaves_train_as_without(model_name):
    """Slapo-ZeRO3 makes each transformer layer a ZeRO-3 leaf module, compiled or not (one
    gather a layer): the losses are those of ZeRO-3's hooks on every module, to 1e-6, half
    of the layers checkpointed. T5's first block holds the relative position embedding, and
    stays no leaf."""
    hooked = run_ranks(_zero3_schedule, model_name, False)
    leaves = run_ranks(_zero3_schedule, model_name, False, True)
    blocks = {"bert-tiny": [f"bert.encoder.layer.{i}" for i in range(2)],
              "llama-tiny": [f"model.layers.{i}" for i in range(2)],
              "t5-tiny": ["encoder.block.1", "decoder.block.1"]}[model_name]
    for rank in range(2):
        assert hooked[rank][1] == [] and leaves[rank][1] == blocks
        assert leaves[rank][0] == pytest.approx(hooked[rank][0], rel=1e-6)
        assert leaves[rank][0][0] != leaves[rank][0][2]


def _zero3_with_upstreams_topology():
    """Upstream's DeepSpeed scripts: build(sch, topology=PipeModelDataParallelTopology(...),
    target="deepspeed", config=..., loss_fn=None); it was a TypeError from deepspeed."""
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    _start_zero3_rank()
    sch = slapo.create_schedule(nn.Sequential(Embed(), Block()))
    topology = PipeModelDataParallelTopology(num_pp=1, num_mp=1, num_dp=dist.get_world_size())
    engine, _ = slapo.build(sch, target="deepspeed", init_weights=False, config=ZERO3,
                            optimizer=torch.optim.SGD(sch.mod.parameters(), lr=0.1),
                            topology=topology, loss_fn=None)
    ids = torch.randint(0, 10, (2, 3), generator=torch.Generator().manual_seed(0))
    losses, _ = _zero3_steps(engine, [ids] * 2, lambda e, x: e(x).pow(2).mean())
    try:
        slapo.build(slapo.create_schedule(nn.Sequential(Block())), target="deepspeed",
                    config=ZERO3, topology=PipeModelDataParallelTopology(
                        num_pp=2, num_mp=1, num_dp=1))
    except ValueError as err:
        refused = str(err)
    return losses, engine.mpu is not None, refused


@pytest.mark.slow
def test_zero3_takes_upstreams_deepspeed_topology_as_its_mpu():
    for losses, has_mpu, refused in run_ranks(_zero3_with_upstreams_topology):
        assert len(losses) == 2 and all(math.isfinite(x) for x in losses) and has_mpu
        assert "the topology has 2 pipeline stages, but the schedule has no pipeline cuts" \
            in refused
