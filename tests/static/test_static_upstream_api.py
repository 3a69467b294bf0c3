"""Upstream Slapo's static-graph API: ``trace(recursive=, tracer=, config=,
leaf_modules=)``, ``find`` tracing on demand and returning ``[(path, node), ...]`` / matches
of ``(path, node)``, ``Pattern`` / ``ModulePattern`` / ``call_module`` and functionals that
match module calls, every form of ``find`` taken by ``replace``, ``fuse`` and ``checkpoint``,
upstream's default names, and ``replace_all``.

Single process. A changed model is compared with the plain one on the same inputs: exactly
(``atol=0``) where the computation is the same ops, to 1e-6 where a replacement computes the
same values another way; gradients after one backward, to 1e-6.
"""

import copy

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from static_models import Together, additive_mask, bert_config, hidden
from torch import nn

import slapo
from slapo.pattern import Match, ModulePattern, Pattern, call_module


class Block(nn.Module):
    """fc1 -> ReLU module -> fc2 -> F.relu, with q/k/v projections of one input beside."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 6)
        self.act = nn.ReLU()
        self.q, self.k, self.v = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x):
        y = F.relu(self.fc2(self.act(self.fc1(x))))
        return y + torch.softmax(self.q(y) * self.k(y), dim=-1) * self.v(y)


class Outer(nn.Module):
    """A Block under a parent, so that matches lie in a graph below the node find runs on."""

    def __init__(self):
        super().__init__()
        self.block = Block()
        self.norm = nn.LayerNorm(6)

    def forward(self, x):
        return self.norm(self.block(x))


def _copies(cls=Outer):
    torch.manual_seed(0)
    plain = cls()
    return plain, slapo.create_schedule(copy.deepcopy(plain))


X = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))


def _same(model, plain, atol=0.0):
    torch.testing.assert_close(model(X), plain(X), rtol=0, atol=atol)


def _calls(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_module"]


# --- trace ---------------------------------------------------------------------------------
def test_trace_recursive_false_leaves_the_children_as_calls():
    plain, sch = _copies()
    assert sch.trace(recursive=False) is True  # upstream's return value
    assert _calls(sch.mod) == ["block", "norm"]
    assert not isinstance(sch["block"].mod, fx.GraphModule)
    _same(sch.mod, plain)
    # recursive=True (the default) traces the block into its own graph
    _, deep = _copies()
    deep.trace()
    assert isinstance(deep["block"].mod, fx.GraphModule)


def test_leaf_modules_is_upstreams_spelling_of_leaves():
    _, sch = _copies()
    sch.trace(flatten=True, leaf_modules=["Block"])
    assert _calls(sch.mod) == ["block", "norm"]


def test_huggingface_tracer_makes_example_inputs_from_the_config():
    from transformers.models.bert.modeling_bert import BertLayer
    torch.manual_seed(0)
    plain = BertLayer(bert_config()).eval()
    sch = slapo.create_schedule(copy.deepcopy(plain))
    sch.trace(tracer="huggingface", config=bert_config())
    assert [n.name for n in sch.mod.graph.nodes if n.op == "placeholder"] == \
        ["hidden_states", "attention_mask"]
    x, mask = hidden(3, 5, 1), additive_mask(3, 5, 1)  # other shapes than the made ones
    torch.testing.assert_close(sch.mod(x, mask)[0], plain(x, mask)[0], rtol=0, atol=0)
    assert sch.find("softmax")[0][0] == "attention.self"


def test_huggingface_tracer_takes_a_models_own_config():
    from transformers import BertModel
    torch.manual_seed(0)
    plain = BertModel(bert_config()).eval()
    sch = slapo.create_schedule(copy.deepcopy(plain))
    sch.trace(tracer="huggingface", concrete_args={"use_cache": False})
    inputs = [n.name for n in sch.mod.graph.nodes if n.op == "placeholder"]
    assert inputs == ["input_ids", "attention_mask", "token_type_ids", "position_ids"]
    batch = {"input_ids": torch.randint(0, 100, (3, 6), generator=torch.Generator()
                                        .manual_seed(2)),
             "attention_mask": torch.ones(3, 6, dtype=torch.long),  # a model's 0/1 mask
             "token_type_ids": torch.zeros(3, 6, dtype=torch.long),
             "position_ids": torch.arange(6).expand(3, 6)}
    torch.testing.assert_close(sch.mod(**batch).last_hidden_state,
                               plain(**batch).last_hidden_state, rtol=0, atol=0)


def test_unknown_tracer_and_missing_config_are_errors():
    _, sch = _copies()
    with pytest.raises(ValueError, match=r"unknown tracer 'fx'.*'pytorch', 'huggingface', "
                                         r"'dynamo'"):
        sch.trace(tracer="fx")
    with pytest.raises(ValueError, match="makes example inputs from the model config"):
        sch.trace(tracer="huggingface")
    from transformers.models.bert.modeling_bert import BertIntermediate
    ffn = slapo.create_schedule(BertIntermediate(bert_config()))
    with pytest.raises(TypeError, match="expects a transformers config"):
        ffn.trace(tracer="huggingface", config={"hidden_size": 32})


# --- find ------------------------------------------------------------------------------------
def test_find_traces_on_demand_and_names_the_graph_of_each_node():
    _, sch = _copies()
    found = sch.find("softmax")  # not traced yet: find traces (hierarchy kept)
    assert isinstance(sch.mod, fx.GraphModule)
    assert [(path, n.name) for path, n in found] == [("block", "softmax")]
    path, node = found[0]
    assert node.graph is sch[path].mod.graph
    # from the block itself the same node is in its own graph
    assert [(p, n.name) for p, n in sch["block"].find("softmax")] == [("", "softmax")]
    assert sch.find_node(lambda n: n.op == "call_module" and n.target == "norm") == \
        [("", next(n for n in sch.mod.graph.nodes if n.target == "norm"))]


def test_functional_pattern_matches_module_calls_too():
    _, sch = _copies()
    matches = sch.find(lambda x: F.relu(x))  # the nn.ReLU call and the F.relu call
    assert all(isinstance(m, Match) for m in matches)
    assert [[(p, n.op) for p, n in m] for m in matches] == \
        [[("block", "call_module")], [("block", "call_function")]]
    assert [m.nodes[0].name for m in matches] == ["act", "relu"]
    assert [m.inputs[0].name for m in matches] == ["fc1", "fc2"]


def test_call_module_pattern_matches_by_path():
    _, sch = _copies()
    found = sch.find(lambda x: F.relu(call_module(r"fc\d", x)))
    assert [[n.name for n in m.nodes] for m in found] == [["fc1", "act"], ["fc2", "relu"]]
    with pytest.raises(RuntimeError, match="stands for a module call in a pattern"):
        call_module("fc1", X)


class FcRelu(Pattern):
    def __init__(self):
        super().__init__()
        self.fc = ModulePattern(r"fc\d")

    def forward(self, x):
        return F.relu(self.fc(x))


class LinearTimes(Pattern):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(1, 1), nn.Linear(1, 1)  # match any nn.Linear calls

    def forward(self, x):
        return self.a(x) * self.b(x)


def test_pattern_classes_match_module_paths_and_classes():
    _, sch = _copies()
    assert [[n.name for n in m.nodes] for m in sch.find(FcRelu())] == \
        [["fc1", "act"], ["fc2", "relu"]]
    (qk,) = sch.find(LinearTimes())
    assert [n.name for n in qk.nodes] == ["q", "k", "mul"] and qk.path == "block"
    with pytest.raises(NotImplementedError, match="never called"):
        ModulePattern("x")(X)


# --- replace / fuse / checkpoint with every form ---------------------------------------------
def test_replace_takes_a_regex_result_side_by_side_with_upstreams_name():
    plain, sch = _copies()
    qkv = sch.find(r"^[qkv]$")  # [(path, node)] * 3: upstream's horizontal fusion
    block = sch["block"].mod
    sch.replace(Together(block.q, block.k, block.v), qkv)
    assert "Together_0" in _calls(sch["block"].mod) and "Together_0" in sch["block"].child
    assert not {"q", "k", "v"} & set(_calls(sch["block"].mod))
    _same(sch.mod, plain)


def test_replace_takes_finds_full_result_and_a_single_pair():
    plain, sch = _copies()
    def clamp(x):
        return torch.clamp_min(x, 0.0)

    sch.replace(clamp, sch.find(lambda x: F.relu(x))[:1])  # the nn.ReLU call, replaced
    graph = sch["block"].mod.graph  # a function is called as itself, as upstream
    assert [n.op for n in graph.nodes if n.target is clamp] == ["call_function"]
    ((path, node),) = sch.find("norm")
    sch.replace(nn.Identity(), (path, node), name="skip_norm")  # upstream: <name>_0
    assert "skip_norm_0" in _calls(sch.mod)
    expected = copy.deepcopy(plain)
    expected.norm = nn.Identity()
    _same(sch.mod, expected)


def test_fuse_from_a_parent_registers_on_the_graph_holding_the_match():
    plain, sch = _copies()
    first = sch.find(FcRelu())[0]
    fused = sch.fuse(first, compiler=None)
    second = sch.find(FcRelu())[0]
    sch.fuse(second, compiler=None)
    # upstream's uncompiled fusion of module calls: a Sequential of them, its class named so
    assert type(fused).__name__ == "FusedModule" and isinstance(fused, nn.Sequential)
    assert fused is sch["block.FusedModule_0"].mod is sch["block"].mod.FusedModule_0
    assert "FusedModule_1" in sch["block"].child
    _same(sch.mod, plain)


def test_checkpoint_of_a_pair_and_of_several_matches_keeps_the_gradients():
    plain, sch = _copies()
    sch.checkpoint(subgraph=sch.find("softmax")[0])
    sch.checkpoint(subgraph=sch.find(FcRelu()))  # two matches: one call side by side
    assert {"CheckPointWrapper_0", "CheckPointWrapper_1"} <= set(sch["block"].child)
    assert sch["block.CheckPointWrapper_1"].mod._slapo_checkpointed
    x = X.clone().requires_grad_()
    for model in (plain, sch.mod):
        model(x).square().sum().backward()
    for (name, p), (_, s) in zip(plain.named_parameters(), sch.mod.named_parameters()):
        torch.testing.assert_close(s.grad, p.grad, rtol=0, atol=1e-6, msg=name)


def test_a_path_that_is_not_the_nodes_graph_is_an_error():
    _, sch = _copies()
    ((_, node),) = sch.find("softmax")
    with pytest.raises(ValueError, match=r"names the graph\(s\) \['norm'\].*at 'block'"):
        sch.fuse(("norm", node), compiler=None)


def test_stale_and_foreign_matches_are_errors():
    _, sch = _copies()
    match = sch.find(FcRelu())[0]
    sch.fuse(match, compiler=None)
    with pytest.raises(ValueError, match="stale: find them again"):
        sch.fuse(match, compiler=None)
    _, other = _copies()
    with pytest.raises(ValueError, match=r"not in a graph of '<root>' or below it"):
        other.fuse(sch.find(FcRelu())[0], compiler=None)


# --- replace_all ---------------------------------------------------------------------------
class TwoActs(nn.Module):
    def __init__(self):
        super().__init__()
        self.one = nn.Sequential(nn.Linear(6, 6), nn.ReLU())
        self.two = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Sequential(nn.ReLU()))

    def forward(self, x):
        return self.two(self.one(x))


def test_replace_all_modules_of_a_class():
    plain, sch = _copies(TwoActs)
    seen = []

    def make(path, mod):
        seen.append((path, type(mod).__name__))
        return nn.GELU()

    assert sch.replace_all(nn.ReLU, make) == ["one.1", "two.1", "two.2.0"]
    assert seen == [("one.1", "ReLU"), ("two.1", "ReLU"), ("two.2.0", "ReLU")]
    expected = copy.deepcopy(plain)
    expected.one[1], expected.two[1], expected.two[2][0] = nn.GELU(), nn.GELU(), nn.GELU()
    _same(sch.mod, expected)
    # a module inside one that is replaced goes with it
    _, outer = _copies(TwoActs)
    assert outer.replace_all(nn.Sequential, lambda path, mod: nn.Identity()) == ["one", "two"]


def test_replace_all_matches_of_a_pattern_last_to_first():
    class Chain(nn.Module):
        def forward(self, x):
            return F.relu(F.relu(x - 0.5)) * 2  # the second match reads the first

    plain, sch = _copies(Chain)
    paths = sch.replace_all(lambda x: F.relu(x), lambda path, match: nn.ReLU())
    assert paths == ["", ""]
    assert _calls(sch.mod) == ["ReLU_0", "ReLU_1"]
    assert "relu" not in [getattr(n.target, "__name__", "") for n in sch.mod.graph.nodes]
    _same(sch.mod, plain)


def test_replace_all_errors():
    _, sch = _copies(TwoActs)
    with pytest.raises(TypeError, match="make_mod_fn is the class GELU; pass the target first"):
        sch.replace_all(nn.ReLU, nn.GELU)
    with pytest.raises(ValueError, match="no Dropout at or below '<root>'"):
        sch.replace_all(nn.Dropout, lambda path, mod: nn.Identity())
