"""Upstream Slapo's schedules as its users wrote them: tracing transformers blocks without
example inputs whatever tracer is named, the flattened trace's schedule tree, hooks that
survive a trace, and the matcher's and replace's semantics. Each result is checked against
the plain module it came from."""

from __future__ import annotations

import copy
import inspect
import operator

import pytest
import torch
import torch.nn.functional as F
from static_models import additive_mask, bert_config, gpt_neo_config, hidden
from torch import fx, nn

import slapo
from slapo.utils.common import get_hooks


def upstream_concrete_args(mod, inputs):
    """Every other argument fixed to its default, as upstream's tests and scripts wrote it."""
    return {p.name: p.default for p in inspect.signature(mod.forward).parameters.values()
            if p.name not in inputs}


def _bert():
    from transformers import BertModel
    torch.manual_seed(0)
    return BertModel(bert_config()).eval()


def _gpt_neo():
    from transformers import GPTNeoModel
    torch.manual_seed(0)
    return GPTNeoModel(gpt_neo_config(use_cache=False)).eval()


@pytest.mark.parametrize("tracer", ["pytorch", "huggingface", "dynamo"])
def test_a_bert_block_traces_without_example_inputs(tracer):
    plain = _bert()
    sch = slapo.create_schedule(copy.deepcopy(plain))
    attn = sch["encoder.layer.0.attention"]
    args = upstream_concrete_args(attn.mod, ["hidden_states", "attention_mask"])
    attn.trace(tracer=tracer, concrete_args=args)  # examples from the model's config
    for path in ("", ".self", ".output"):
        assert isinstance(sch[f"encoder.layer.0.attention{path}"].mod, fx.GraphModule)
    assert not isinstance(sch["encoder.layer.0.intermediate"].mod, fx.GraphModule)
    x, mask = hidden(3, 5, 1), additive_mask(3, 5, 2)  # other shapes than the examples
    torch.testing.assert_close(attn.mod(x, attention_mask=mask)[0],
                               plain.encoder.layer[0].attention(x, attention_mask=mask)[0],
                               rtol=0, atol=0)


def test_dynamo_takes_the_tensors_of_concrete_args_as_the_example_call():
    plain = _bert()
    sch = slapo.create_schedule(copy.deepcopy(plain))
    attn = sch["encoder.layer.0.attention.self"]
    args = {"hidden_states": hidden(2, 7, 0),
            **upstream_concrete_args(attn.mod, ["hidden_states"])}
    attn.trace(tracer="dynamo", concrete_args=args)
    graph_inputs = [n.target for n in attn.mod.graph.nodes if n.op == "placeholder"]
    assert graph_inputs == ["hidden_states"]
    x = hidden(3, 5, 1)
    torch.testing.assert_close(attn.mod(x)[0], plain.encoder.layer[0].attention.self(x)[0])


def test_gpt_neo_layer_and_its_attention_trace():
    plain = _gpt_neo()
    sch = slapo.create_schedule(copy.deepcopy(plain))
    layer = sch["h.0"]
    layer.trace(tracer="pytorch",
                concrete_args=upstream_concrete_args(layer.mod, ["hidden_states",
                                                                 "attention_mask"]))
    for path in ("h.0", "h.0.attn", "h.0.mlp", "h.0.attn.attention"):
        assert isinstance(sch[path].mod, fx.GraphModule), path
    x, mask = hidden(2, 6, 3), additive_mask(2, 6, 4)
    torch.testing.assert_close(layer.mod(x, attention_mask=mask)[0],
                               plain.h[0](x, attention_mask=mask)[0], rtol=0, atol=0)

    # upstream's HF-tracer spelling on the attention alone, local attention included
    sch = slapo.create_schedule(copy.deepcopy(plain))
    for i in (0, 1):
        attn = sch[f"h.{i}.attn.attention"]
        attn.trace(recursive=False, flatten=True, tracer="huggingface", config=plain.config,
                   concrete_args=upstream_concrete_args(attn.mod, ["hidden_states"]))
        assert isinstance(attn.mod, fx.GraphModule)
        torch.testing.assert_close(attn.mod(x)[0], plain.h[i].attn.attention(x)[0],
                                   rtol=0, atol=0)


def test_flattened_traces_schedule_one_level_and_refuse_the_next():
    sch = slapo.create_schedule(_bert())
    attn = sch["encoder.layer.0.attention"]
    attn.trace(flatten=True, concrete_args=upstream_concrete_args(
        attn.mod, ["hidden_states", "attention_mask"]))
    calls = [n.target for n in attn.mod.graph.nodes if n.op == "call_module"]
    assert "self.query" in calls and "output.dense" in calls
    assert isinstance(sch["encoder.layer.0.attention.self"].mod, nn.Module)
    with pytest.raises(KeyError, match=r"flatten=True.*get_module\('self.query'\) on the "
                                       r"schedule of 'encoder.layer.0.attention'"):
        sch["encoder.layer.0.attention.self.query"]
    assert isinstance(sch["encoder.layer.0.attention.self"].get_module("query"), nn.Linear)

    from transformers.models.bert.modeling_bert import BertSelfAttention
    sch = slapo.create_schedule(_bert())
    layer = sch["encoder.layer.0"]
    layer.trace(flatten=True, leaf_modules=["BertSelfAttention", "BertSelfOutput"],
                concrete_args=upstream_concrete_args(layer.mod,
                                                     ["hidden_states", "attention_mask"]))
    calls = [n.target for n in layer.mod.graph.nodes if n.op == "call_module"]
    assert "attention.self" in calls and "attention.self.query" not in calls
    with pytest.raises(KeyError, match="inside the graph that trace"):
        sch["encoder.layer.0.attention.self"]
    assert isinstance(layer.get_module("attention.self"), BertSelfAttention)


def test_hooks_survive_a_later_trace():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x):
            return torch.relu(self.linear(x))

    torch.manual_seed(0)
    plain = Model()
    seen = []
    sch = slapo.create_schedule(copy.deepcopy(plain))
    sch.mod.register_forward_pre_hook(lambda mod, args: (args[0] * 2,))
    sch.mod.register_forward_hook(lambda mod, args, out: out + 1)
    sch.mod.register_full_backward_hook(lambda mod, gin, gout: seen.append(len(gin)))
    sch.trace()
    assert {k: len(v) for k, v in get_hooks(sch.mod).items()} == \
        {"fwd_pre": 1, "fwd_post": 1, "bwd_post": 1}
    x = torch.randn(3, 4, requires_grad=True)
    out = sch.mod(x)
    torch.testing.assert_close(out, plain(x * 2) + 1)
    out.sum().backward()
    assert seen == [1]


# --- the matcher ------------------------------------------------------------------------------
class _ResidualReLU(nn.Module):
    def __init__(self, module_relu: bool):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.relu = nn.ReLU() if module_relu else None

    def forward(self, x):
        y = self.conv(x)
        return (self.relu(y) if self.relu is not None else torch.nn.functional.relu(y)) + x


@pytest.mark.parametrize("module_relu", [False, True])
def test_a_pattern_argument_matches_a_value_at_each_use(module_relu):
    sch = slapo.create_schedule(_ResidualReLU(module_relu))
    patterns = [lambda x: F.relu(x) + x]
    if module_relu:
        patterns.append(lambda x: slapo.call_module("relu", x) + x)
    for pattern in patterns:
        (match,) = sch.find(pattern)  # relu(conv(x)) + x: x matches conv's output, then x
        relu, add = (node for _, node in match)
        assert (relu.op, relu.target) == (("call_module", "relu") if module_relu
                                          else ("call_function", F.relu))
        assert add.target is operator.add
        assert [v.name for v in match.inputs] == ["conv", "x"]
        assert match.input_names == ["x", "x"]


def test_a_diamond_matches_with_its_shared_argument():
    class Model(nn.Module):
        def forward(self, x, y, z):
            return (x + y) * (y - z)

    (match,) = slapo.create_schedule(Model()).find(lambda x, y, z: (x + y) * (y - z))
    assert [node.name for _, node in match] == ["add", "sub", "mul"]
    assert [v.name for v in match.inputs] == ["x", "y", "z"]


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        # keys first, as transformers 4 computed them: upstream ordered inputs by first use
        key, value, query = self.k(x), self.v(x), self.q(x)
        scores = torch.matmul(query, key.transpose(-1, -2)) / 8 ** 0.5
        return torch.matmul(torch.softmax(scores, dim=-1), value)


def _core(query_layer, key_layer, value_layer):
    scores = torch.matmul(query_layer, key_layer.transpose(-1, -2)) / 8 ** 0.5
    return torch.matmul(torch.softmax(scores, dim=-1), value_layer)


class _KeyFirst(nn.Module):
    """Written for upstream's input order (first use: key); named like the pattern."""

    def forward(self, key_layer, query_layer, value_layer):
        return torch.nn.functional.scaled_dot_product_attention(query_layer, key_layer,
                                                                value_layer)


@pytest.mark.parametrize("new", [_KeyFirst(), torch.nn.functional.scaled_dot_product_attention])
def test_replacements_get_the_pattern_arguments_by_name_or_in_order(new):
    torch.manual_seed(0)
    plain = _Attention()
    sch = slapo.create_schedule(copy.deepcopy(plain))
    sch.replace(new, sch.find(_core))  # by name for _KeyFirst; (q, k, v) in order for SDPA
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(sch.mod(x), plain(x))


def test_a_replacement_that_takes_other_arguments_needs_concrete_args():

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)
            self.activation = nn.ReLU()

        def forward(self, x):
            return self.activation(self.linear(x)) + x

    class NewMod(nn.Module):
        def forward(self, x, y, z):
            return x + y + z

    torch.manual_seed(0)
    plain = Model()
    sch = slapo.create_schedule(copy.deepcopy(plain))
    matches = sch.find(lambda x: F.relu(x) + x)
    with pytest.raises(ValueError, match=r"cannot take the subgraph's 2 input.*concrete_args"):
        sch.replace(NewMod(), matches)
    assert not any(n.op == "call_module" and n.target.startswith("NewMod")
                   for n in sch.mod.graph.nodes)  # nothing changed ...
    sch.replace(NewMod(), matches, concrete_args={"z": 1.0})
    assert isinstance(sch["NewMod_1"].mod, NewMod)  # ... but the name was taken, as upstream
    x = torch.randn(3, 4)
    torch.testing.assert_close(sch.mod(x), plain.linear(x) + x + 1.0)


def test_a_function_replacing_one_node_takes_its_arguments_as_written():

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, x):
            return F.relu(self.linear(x).view(x.shape[0], 2, 4))

    def double(x):
        return x * 2

    def new_view(tensor, *shape):  # upstream's fix_attention_mask_shape spelling
        return tensor.reshape(*shape)

    torch.manual_seed(0)
    plain = Model()
    sch = slapo.create_schedule(copy.deepcopy(plain))
    (relu,) = sch.find_node(lambda n: n.op == "call_function" and n.target is F.relu)
    sch.replace(double, relu)
    (view,) = sch.find_node(lambda n: n.op == "call_method" and n.target == "view")
    sch.replace(new_view, view)
    calls = [n for n in sch.mod.graph.nodes if n.op == "call_function"]
    assert [n.name for n in calls if n.target in (double, new_view)] == ["new_view", "double"]
    x = torch.randn(3, 8)
    torch.testing.assert_close(sch.mod(x), plain.linear(x).view(3, 2, 4) * 2)


class _LinearBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.activation = nn.ReLU()

    def forward(self, x):
        return self.activation(self.bn(self.linear(x)))


def test_vertical_replacement_moves_the_outer_hooks():
    class Identity(nn.Module):
        def forward(self, x):
            return x

    def pattern(x):
        return slapo.call_module("bn", slapo.call_module("linear", x))

    sch = slapo.create_schedule(_LinearBN())
    sch.mod.linear.register_forward_pre_hook(lambda mod, args: (args[0] * 3,))
    sch.mod.bn.register_forward_hook(lambda mod, args, out: out + 1)
    sch.mod.linear.register_full_backward_hook(lambda mod, gin, gout: None)
    sch.replace(Identity(), sch.find(pattern))
    assert {k: len(v) for k, v in get_hooks(sch["Identity_0"].mod).items()} == \
        {"fwd_pre": 1, "fwd_post": 1, "bwd_post": 1}
    torch.testing.assert_close(sch.mod(torch.ones(2, 4)), torch.full((2, 4), 4.0))

    sch = slapo.create_schedule(_LinearBN())
    sch.mod.linear.register_forward_hook(lambda mod, args, out: out)  # inside the new call
    with pytest.raises(ValueError, match="'linear' has fwd_post hooks, which cannot run"):
        sch.replace(Identity(), sch.find(pattern))


def test_horizontal_replacement_gives_each_output_and_refuses_hooks():

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.fc1(x).transpose(0, 1) + self.fc2(x).transpose(0, 1)

    class Both(nn.Module):
        def forward(self, x):
            return x.transpose(0, 1), 2 * x.transpose(0, 1)

    def pattern(x):
        return slapo.call_module(r"fc1|fc2", x).transpose(0, 1)

    sch = slapo.create_schedule(Two())
    matches = sch.find(pattern)
    assert [m[0][1].target for m in matches] == ["fc1", "fc2"] and len(matches[0]) == 2
    sch.replace(Both(), matches, name="test")
    items = [n for n in sch.mod.graph.nodes
             if n.target is operator.getitem and n.args[0].target == "test_0"]
    assert len(items) == 2
    torch.testing.assert_close(sch.mod(torch.ones(2, 4)), torch.full((4, 2), 3.0))

    sch = slapo.create_schedule(Two())
    sch.mod.fc1.register_forward_pre_hook(lambda mod, args: None)
    with pytest.raises(ValueError, match="several subgraphs side by side"):
        sch.replace(Both(), sch.find(pattern))


def test_replacing_a_module_moves_its_hooks():
    sch = slapo.create_schedule(_LinearBN())
    sch["activation"].mod.register_forward_hook(lambda mod, args, out: out - 1)
    sch["activation"].replace(nn.GELU())
    assert len(get_hooks(sch["activation"].mod)["fwd_post"]) == 1
    torch.testing.assert_close(sch.mod.activation(torch.zeros(3)), torch.full((3,), -1.0))


# --- checkpoint and fuse under upstream's names ---------------------------------------------
class _Layers(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1 = nn.Sequential(nn.Linear(6, 6), nn.ReLU())
        self.layer2 = nn.Linear(6, 6)

    def forward(self, x):
        return self.layer2(self.layer1(x))


def test_a_checkpointed_module_is_upstreams_wrapper_in_place():
    torch.manual_seed(0)
    plain = _Layers()
    sch = slapo.create_schedule(copy.deepcopy(plain))
    sch["layer1"].checkpoint()
    layer1 = sch["layer1"].mod
    assert type(layer1).__name__ == "CheckPointWrapper" and isinstance(layer1, nn.Sequential)
    assert layer1.mod is layer1 and isinstance(layer1.mod[0], nn.Linear)
    names = [n for n, _ in sch.mod.named_parameters()]
    assert names == [n for n, _ in plain.named_parameters()]  # names kept
    x = torch.randn(4, 6, requires_grad=True)
    sch.mod(x).sum().backward()
    plain(x).sum().backward()
    for (name, got), (_, want) in zip(sch.mod.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(got.grad, want.grad, msg=name)

    sch = slapo.create_schedule(copy.deepcopy(plain))
    (match,) = sch.find(lambda x: F.relu(slapo.call_module("0", x)))  # in layer1's graph
    sch.checkpoint(match)  # a subgraph: extracted, as upstream's CheckPointWrapper_0
    wrapper = sch["layer1.CheckPointWrapper_0"].mod
    assert type(wrapper).__name__ == "CheckPointWrapper"
    assert isinstance(getattr(wrapper.mod, "0"), nn.Linear)
    torch.testing.assert_close(sch.mod(x), plain(x))


class _ConvReLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.conv(x)) + 1


def test_a_fused_module_is_named_after_name():
    torch.manual_seed(0)
    plain = _ConvReLU()
    x = torch.randn(1, 3, 6, 6)

    def pattern(x):
        return F.relu(slapo.call_module("conv", x))

    sch = slapo.create_schedule(copy.deepcopy(plain))
    fused = sch.fuse(sch.find(pattern), compiler=None, name="FusedConvReLU")
    assert sch.mod.FusedConvReLU_0 is fused and type(fused).__name__ == "FusedConvReLU"
    assert isinstance(fused[0], nn.Conv2d) and isinstance(fused[1], nn.ReLU)  # a Sequential
    torch.testing.assert_close(sch.mod(x), plain(x))

    sch = slapo.create_schedule(copy.deepcopy(plain))
    fused = sch.fuse(sch.find(lambda x: F.relu(slapo.call_module("conv", x)) + 1),
                     compiler=None, name="ConvReLUAdd")  # not a chain of modules: a graph
    assert type(fused).__name__ == "ConvReLUAdd" and "add" in fused.graph_module.code
    torch.testing.assert_close(sch.mod(x), plain(x))

    sch = slapo.create_schedule(copy.deepcopy(plain))
    fused = sch.fuse(sch.find(pattern), compiler="TorchScript", name="Scripted")
    assert isinstance(sch["Scripted_0"].mod, torch.jit.ScriptModule)
    torch.testing.assert_close(sch.mod(x), plain(x))
    sch.trace()  # stays one call when traced again


class _BiasGeLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.gelu = nn.GELU()

    def forward(self, x):
        return self.gelu(self.linear(x))


class _BiasLayerNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.dropout = nn.Dropout(0.2)
        self.ln = nn.LayerNorm(16)

    def forward(self, x, residual):
        return self.ln(self.dropout(self.linear(x)) + residual)


@pytest.mark.parametrize("compiler", ["TorchScript", None])
def test_bias_gelu_and_bias_layernorm_fusions_keep_the_numbers(compiler):
    """Upstream's fusion checks: decompose the Linear, trace, find the bias add with what
    follows it, fuse, and compare with the plain module (dropout drawn from the same seed)."""
    torch.manual_seed(0)
    x, residual = torch.randn(2, 4, 16), torch.randn(2, 4, 16)
    for plain, pattern, inputs, expected_nodes in (
            (_BiasGeLU(), lambda x, bias: F.gelu(bias + x), (x,), [operator.add, "gelu"]),
            (_BiasLayerNorm(), lambda x, bias, residual: F.layer_norm(
                F.dropout(x + bias) + residual, 16), (x, residual),
             [operator.add, "dropout", operator.add, "ln"])):
        sch = slapo.create_schedule(copy.deepcopy(plain))
        sch["linear"].decompose()
        sch.trace(flatten=True)
        (match,) = sch.find(pattern)
        assert [node.target for _, node in match] == expected_nodes
        sch.fuse(match, compiler=compiler, name="Fused")
        torch.manual_seed(1)
        out = sch.mod(*inputs)
        torch.manual_seed(1)
        torch.testing.assert_close(out, plain(*inputs))


def test_a_block_of_a_model_on_the_meta_device_traces():
    from transformers import BertModel
    with slapo.init_empty_weights():
        model = BertModel(bert_config(attn_implementation="sdpa"))  # SDPA branches on shapes
    sch = slapo.create_schedule(model)
    attn = sch["encoder.layer.0.attention.self"]
    attn.trace(recursive=False, flatten=True,
               concrete_args=upstream_concrete_args(attn.mod, ["hidden_states"]))
    calls = [n.target for n in attn.mod.graph.nodes if n.op == "call_module"]
    assert calls == ["query", "key", "value"]
