"""Single-process behaviour of the core primitives and their errors."""

import copy

import pytest
import torch
from tiny_modules import AttentionBlock, MLPBlock, schedule_mlp
from torch import nn

import slapo
from slapo.primitives.replace import FunctionModule


def test_list_primitives_and_help():
    names = slapo.list_primitives()
    for expected in ("replace", "shard", "sync", "checkpoint", "fork_rng", "annotate"):
        assert expected in names
    sch = slapo.create_schedule(MLPBlock())
    for name in names:
        assert getattr(sch, name).__doc__.strip(), f"primitive {name} has no docstring"
    assert "shard" in dir(sch)


def test_tree_mirrors_module_hierarchy():
    model = nn.Sequential(MLPBlock(), nn.ModuleList([AttentionBlock(), AttentionBlock()]))
    sch = slapo.create_schedule(model)
    node = sch["1.0.attn.q"]
    assert node.mod is model[1][0].attn.q
    assert node.path == "1.0.attn.q" and node.name == "q"
    assert node.parent.path == "1.0.attn"
    assert sch["1"]["0.attn"].mod is model[1][0].attn
    assert list(sch["0"].child) == ["norm", "fc1", "fc2"]
    assert sch.world_size == 1 and sch.rank == 0 and sch.group is None
    assert [p for p, _ in sch.named_schedules()] == [n for n, _ in model.named_modules()]


def test_unknown_path_names_closest():
    sch = slapo.create_schedule(nn.Sequential(AttentionBlock()))
    with pytest.raises(KeyError, match=r"0\.attn\.qq.*closest existing paths: 0\.attn\.q"):
        sch["0.attn.qq"]
    with pytest.raises(KeyError, match=r"no submodule '0\.attn\.x'.*0\.attn\.(q|k|v|out)"):
        sch["0.attn.x"]
    with pytest.raises(KeyError, match="'0.attn.q.weight' is a parameter, not a submodule"):
        sch["0.attn.q.weight"]


def test_unknown_primitive_is_attribute_error():
    sch = slapo.create_schedule(MLPBlock())
    with pytest.raises(AttributeError, match="shardd"):
        sch.shardd("weight", 0)


def test_wrong_parameter_name():
    sch = slapo.create_schedule(MLPBlock())
    with pytest.raises(ValueError, match=r"module 'fc1' \(Linear\) has no parameter 'weights'; "
                                         r"its own parameters: weight, bias"):
        sch["fc1"].shard("weights", axis=0)
    with pytest.raises(ValueError, match="has 2 axes"):
        sch["fc1"].shard("weight", axis=2)


@pytest.mark.parametrize("kwargs, message", [
    (dict(mode="fwd_middle"), "unknown sync mode 'fwd_middle' at 'fc1'"),
    (dict(mode="fwd_post", sync_op_or_fn="all_sum"), "unknown sync op 'all_sum' at 'fc1'"),
    (dict(mode="bwd_post", sync_op_or_fn="all_gather"), "changes the gradient's shape"),
])
def test_bad_sync_arguments(kwargs, message):
    sch = slapo.create_schedule(MLPBlock())
    with pytest.raises(ValueError, match=message):
        sch["fc1"].sync(**kwargs)


def test_world_size_one_schedule_is_identity():
    torch.manual_seed(0)
    plain = MLPBlock()
    sch = slapo.create_schedule(copy.deepcopy(plain))
    schedule_mlp(sch)
    model = slapo.build_module(sch)
    x = torch.randn(2, 3, 32)
    torch.testing.assert_close(model(x), plain(x), rtol=0, atol=0)
    assert slapo.shard_spec(model.fc1.weight) == slapo.ShardSpec(0, 1, (128, 32))


def test_replace_with_module_keeps_tree_consistent():
    model = AttentionBlock()
    sch = slapo.create_schedule(model)
    old_q = model.attn.q
    sch["attn.q"].annotate("weight", "note", 1)
    sch["attn.q"].replace(nn.Linear(32, 32))
    assert model.attn.q is not old_q and sch["attn.q"].mod is model.attn.q
    # Annotations carry over to the same-named parameter of the new module.
    assert slapo.get_annotations(model.attn.q.weight) == {"note": 1}
    # The new module's children are schedulable.
    sch["attn.q"].replace(nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 32)))
    assert sch["attn.q.1"].mod is model.attn.q[1]
    sch["attn.q.1"].shard("weight", axis=1)
    assert model(torch.randn(2, 4, 32)).shape == (2, 4, 32)


def test_replace_with_function():
    model = MLPBlock()
    sch = slapo.create_schedule(model)
    sch["norm"].replace(lambda x: x * 2)
    assert isinstance(model.norm, FunctionModule)
    x = torch.randn(2, 32)
    torch.testing.assert_close(model(x), x + model.fc2(nn.functional.gelu(model.fc1(2 * x))))
    with pytest.raises(TypeError, match="module or a callable"):
        sch["fc1"].replace(3)


def test_what_a_schedule_puts_in_a_model_takes_the_models_training_mode():
    """A model scheduled in eval mode must compute as it did (upstream left a new module in
    training mode: a Dropout swapped into an eval-mode BERT dropped activations)."""
    for mode in (True, False):
        model = nn.Sequential(MLPBlock(), nn.Dropout(0.5)).train(mode)
        sch = slapo.create_schedule(model)
        sch["1"].replace(nn.Dropout(0.5))  # a new module, in training mode until replaced
        sch["0"].trace(flatten=True)
        mlp = sch["0"]
        mlp.replace(nn.GELU(), subgraph=mlp.find(r"gelu"))
        states = {name: mod.training for name, mod in slapo.build_module(sch).named_modules()}
        assert set(states.values()) == {mode}, states
    x = torch.randn(2, 32)
    torch.testing.assert_close(model(x), model(x))  # eval mode: no dropout


def test_annotation_survives_sharding():
    sch = slapo.create_schedule(MLPBlock())
    sch["fc1"].annotate("weight", "tp", "column")
    sch["fc1"].shard("weight", axis=0)
    assert slapo.get_annotations(sch["fc1"].mod.weight) == {"tp": "column"}


def test_custom_sync_functions_run_in_order():
    model = MLPBlock()
    sch = slapo.create_schedule(model)
    sch["fc2"].sync("fwd_post", lambda t: t + 1)
    sch["fc2"].sync("fwd_post", lambda t: t * 10)
    sch["fc1"].sync("fwd_pre", lambda t: t * 0)
    grads = []
    sch["fc1"].sync("bwd_post", lambda g: grads.append(g) or g)
    x = torch.randn(2, 32)
    out = model(x)
    inner = model.fc2(nn.functional.gelu(model.fc1.bias.expand(2, -1)))  # fc1 saw zeros
    torch.testing.assert_close(out, x + inner)  # the hooks ran on the call inside forward
    out.sum().backward()
    assert len(grads) == 1 and grads[0].shape == (2, 32)


def test_build_runs_init_weights_and_refuses_meta_parameters():
    with torch.device("meta"):
        model = MLPBlock()
    sch = slapo.create_schedule(model)
    with pytest.raises(ValueError, match="meta device after build: norm.weight"):
        slapo.build_module(sch)
    model.to_empty(device="cpu")

    def init(module):
        if isinstance(module, nn.Linear):
            nn.init.constant_(module.weight, 0.5)
            nn.init.zeros_(module.bias)

    built = slapo.build_module(sch, init_weights=init)
    assert built is model and torch.all(model.fc1.weight == 0.5)
    assert torch.all(model.fc2.bias == 0)


def test_shard_names_its_module_for_an_axis_or_names_it_cannot_take():
    sch = slapo.create_schedule(nn.Sequential(nn.Linear(4, 4)))
    for axis in ("0", 1.0, None, True):  # an int's lookalikes failed deep in the shard
        with pytest.raises(TypeError, match=r"shard at '0': axis must be an integer"):
            sch["0"].shard("weight", axis=axis)
    with pytest.raises(ValueError, match=r"shard at '0': no parameter named"):
        sch["0"].shard([], axis=0)
