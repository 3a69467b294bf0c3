"""``decompose``, ``find``, ``fuse``, ``replace(subgraph=...)`` and ``checkpoint(subgraph=...)``
keep what a traced block computes:

- bias + GeLU found after ``decompose`` and fused with inductor (BERT) or left uncompiled
  (GPT-Neo's tanh GeLU);
- the attention core (matmul -> scale -> +mask -> softmax -> dropout -> matmul) found in BERT,
  OPT and LLaMA and replaced by ``scaled_dot_product_attention``, or checkpointed;
- (a decomposed Linear stays shardable: see test_static_distributed.py).

Tolerance: 3 SGD steps in fp32, relative error (``slapo.verify``) of loss, output and every
gradient at most 1e-5. Bad input (a pattern matching nothing, a subgraph that is not
connected or not convex, an unknown compiler, a misplaced decompose) raises a clear error.
"""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from static_models import (
    EXAMPLE,
    RUN,
    STEPS,
    assert_trains_alike,
    bert_config,
    blocks,
    square_loss,
    t5_config,
)
from torch import nn

import slapo
from slapo.primitives.decompose import DecomposedLinear
from slapo.primitives.fuse import FusedModule
from slapo.verify import train_side_by_side


def bias_gelu(x, bias):
    return F.gelu(x + bias)


def bias_gelu_tanh(x, bias):  # transformers' NewGELUActivation after a bias add
    y = x + bias
    inner = math.sqrt(2.0 / math.pi) * (y + 0.044715 * torch.pow(y, 3.0))
    return 0.5 * y * (1.0 + torch.tanh(inner))


def attention_core(q, k, v, mask):  # BERT: eager attention
    scores = torch.matmul(q, k.transpose(2, 3)) * 0.125 + mask
    probs = F.dropout(F.softmax(scores, dim=-1), p=0.1, training=True)
    return torch.matmul(probs, v)


def attention_core_fp32_softmax(q, k, v, mask):  # OPT, LLaMA: softmax in fp32, cast back
    scores = torch.matmul(q, k.transpose(2, 3)) * 0.125 + mask
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(torch.float32)
    probs = F.dropout(probs, p=0.1, training=True)
    return torch.matmul(probs, v)


def _traced(name, flatten=False):
    factory, inputs = blocks()[name]
    torch.manual_seed(0)
    plain = factory()
    sch = slapo.create_schedule(copy.deepcopy(plain))
    sch.trace(flatten=flatten, example_inputs=inputs(*EXAMPLE, seed=100))
    return plain, sch, [inputs(*RUN, seed=s) for s in range(STEPS)]


def test_bias_gelu_decomposed_found_and_fused_with_inductor():
    plain, sch, batches = _traced("bert.BertLayer")
    ffn = sch["intermediate"]
    ffn["dense"].decompose()
    assert isinstance(ffn["dense"].mod, DecomposedLinear)
    matches = ffn.find(bias_gelu)
    assert [[(path, n.name) for path, n in m] for m in matches] == [[("", "add"), ("", "gelu")]]
    assert [n.name for n in matches[0].inputs] == ["dense", "dense_decomposed_bias"]
    fused = ffn.fuse(matches[0], compiler="inductor", name="bias_gelu")
    assert isinstance(ffn["bias_gelu_0"].mod, FusedModule) and fused is ffn.mod.bias_gelu_0
    assert [n.op for n in ffn.mod.graph.nodes] == ["placeholder", "call_module", "get_attr",
                                                  "call_module", "output"]
    model = slapo.build_module(sch)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert_trains_alike(train_side_by_side(plain, model, batches, square_loss), "bias_gelu")


def test_tanh_gelu_of_gpt_neo_fused_uncompiled():
    plain, sch, batches = _traced("gpt_neo.GPTNeoMLP")
    sch["c_fc"].decompose()
    match = sch.find(bias_gelu_tanh)
    assert len(match) == 1 and len(match[0]) == 9
    sch.fuse(match[0], compiler=None, name="bias_gelu")
    assert "tanh" not in sch.mod.code
    scheduled = slapo.build_module(sch)
    assert_trains_alike(train_side_by_side(plain, scheduled, batches, square_loss), "neo")


@pytest.mark.parametrize("name, pattern, scale", [
    ("bert.BertLayer", attention_core, None),
    ("opt.OPTDecoderLayer", attention_core_fp32_softmax, 1.0),  # OPT scales q beforehand
    ("llama.LlamaDecoderLayer", attention_core_fp32_softmax, None),
])
def test_attention_core_replaced_by_sdpa(name, pattern, scale):
    # Layers, not attention modules: those return the probabilities too, so a pattern that
    # ends at the context would leave a value used outside the match (see test_checkpoint_...).
    plain, sch, batches = _traced(name, flatten=True)
    (core,) = sch.find(pattern)
    # traced in train mode, the attention's dropout is a module call (it follows the mode)
    ops = [type(sch.mod.get_submodule(n.target)).__name__.lower() if n.op == "call_module"
           else getattr(n.target, "__name__", n.target) for n in core.nodes]
    assert ops[:2] == ["transpose", "matmul"] and ops[-2:] == ["dropout", "matmul"]
    assert "softmax" in ops and [n.name for n in core.outputs] == [core.nodes[-1].name]

    def sdpa(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)

    sch.replace(sdpa, subgraph=core, name="sdpa")
    assert "softmax" not in sch.mod.code  # the function is called as itself, as upstream
    assert [n.name for n in sch.mod.graph.nodes if n.target is sdpa] == ["sdpa"]
    scheduled = slapo.build_module(sch)
    assert_trains_alike(train_side_by_side(plain, scheduled, batches, square_loss), name)


def test_checkpoint_subgraph():
    plain, sch, batches = _traced("bert.BertSelfAttention", flatten=True)

    def core_with_probs(q, k, v, mask):  # BertSelfAttention returns the probabilities too
        probs = F.dropout(F.softmax(torch.matmul(q, k.transpose(2, 3)) * 0.125 + mask, dim=-1),
                          p=0.1, training=True)
        return torch.matmul(probs, v), probs

    (core,) = sch.find(core_with_probs)
    sch.checkpoint(subgraph=core, name="core")
    assert sch["core_0"].mod._slapo_checkpointed
    scheduled = slapo.build_module(sch)
    assert_trains_alike(train_side_by_side(plain, scheduled, batches, square_loss), "ckpt")


def test_find_regex_and_predicate():
    _, sch, _ = _traced("bert.BertSelfAttention", flatten=True)
    assert [(path, n.name) for path, n in sch.find("softmax")] == [("", "softmax")]
    found = sch.find(r"^(query|key|value)$")
    assert [n.target for _, n in found] == ["query", "key", "value"]
    calls = sch.find(lambda node: node.op == "call_module")
    # the attention's dropout, traced in train mode, is a module call (as in transformers 4)
    assert [n.target for _, n in calls] == ["query", "key", "value", "dropout"]
    assert sch.find("no-such-op", allow_empty=True) == []


# --- errors ---------------------------------------------------------------------------
def test_pattern_matching_nothing_is_empty_as_upstream_or_an_error_when_asked():
    _, sch, _ = _traced("bert.BertIntermediate")
    # upstream's schedules loop over what they find (fix_attention_mask_shape: no expand)
    assert sch.find("softmax") == [] and sch.find_node("softmax") == []
    assert sch.find(bias_gelu) == []
    with pytest.raises(ValueError, match=r"matches nothing in '<root>'.*operations: dense"):
        sch.find(bias_gelu, allow_empty=False)  # the bias add is inside the Linear
    with pytest.raises(ValueError, match="matches nothing"):
        sch.find("softmax", allow_empty=False)
    with pytest.raises(ValueError, match=r"find: '\(\[' is no regular expression"):
        sch.find("([")


def test_subgraph_not_connected_is_an_error_unless_side_by_side():
    _, sch, _ = _traced("bert.BertSelfAttention", flatten=True)
    (_, query), (_, value) = sch.find(r"^(query|value)$")
    with pytest.raises(ValueError, match="is not connected"):
        sch.fuse([query, value], compiler=None)  # nodes: one subgraph
    # given as two subgraphs, they fuse side by side (horizontal fusion) into one call
    sch.fuse([[query], [value]], compiler=None, name="query_value")
    calls = {n.target for n in sch.mod.graph.nodes if n.op == "call_module"}
    assert "query_value_0" in calls and not {"query", "value"} & calls


class _Diamond(nn.Module):
    def forward(self, x):
        y = x * 2
        return y + torch.relu(y)


def test_subgraph_not_convex_is_an_error():
    sch = slapo.create_schedule(_Diamond())
    sch.trace()
    (_, mul), (_, add) = sch.find(r"^(mul|add)$")
    with pytest.raises(ValueError, match="not convex: 'relu' uses a value of the subgraph"):
        sch.fuse([mul, add], compiler=None)
    ((_, relu),) = sch.find("relu")
    sch.fuse([mul, relu, add], compiler=None, name="all")  # the whole diamond is fine
    x = torch.randn(3)
    torch.testing.assert_close(sch.mod(x), _Diamond()(x))


def test_unknown_compiler_is_an_error():
    _, sch, _ = _traced("bert.BertIntermediate")
    sch["dense"].decompose()
    with pytest.raises(ValueError, match="unknown compiler 'tvm-please'.*inductor"):
        sch.fuse(sch.find(bias_gelu)[0], compiler="tvm-please")


def test_untraced_and_misplaced_primitives_are_errors():
    from transformers.models.bert.modeling_bert import BertIntermediate
    from transformers.models.t5.modeling_t5 import T5LayerFF
    sch = slapo.create_schedule(BertIntermediate(bert_config()))
    sch["dense"].decompose()  # untraced: upstream's order (see the test below)
    with pytest.raises(TypeError, match="applies to an nn.Linear"):
        sch["dense"].decompose()
    t5 = slapo.create_schedule(T5LayerFF(t5_config()))
    t5.trace()
    with pytest.raises(ValueError, match="has no bias"):
        t5["DenseReluDense.wi"].decompose()
    with pytest.raises(TypeError, match="applies to an nn.Linear"):
        t5["layer_norm"].decompose()


def test_decompose_before_trace_as_upstream_orders_it():
    from transformers.models.bert.modeling_bert import BertIntermediate

    from slapo.op import LinearWithSeparateBias

    torch.manual_seed(0)
    plain = BertIntermediate(bert_config())
    sch = slapo.create_schedule(copy.deepcopy(plain))
    weight = sch["dense"].mod.weight
    sch["dense"].decompose()
    assert isinstance(sch["dense"].mod, LinearWithSeparateBias)
    assert sch["dense"].mod.weight is weight  # the same parameters
    sch.trace(flatten=True)
    (match,) = sch.find(bias_gelu)  # the bias add is now an op of the graph
    sch.fuse(match, compiler=None)
    assert "gelu" not in sch.mod.code
    x = torch.randn(2, 5, plain.dense.in_features)
    assert torch.allclose(slapo.build_module(sch)(x), plain(x), atol=1e-6)
