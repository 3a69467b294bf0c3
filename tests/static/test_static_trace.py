"""``trace`` keeps what a module computes: each block of the paper's HF families (BERT, RoBERTa,
GPT-Neo, OPT, T5, LLaMA), traced with and without ``flatten``, trains like the untraced block,
and whole models trace too. The traced graphs are run on other batch sizes and sequence
lengths than the example inputs they were traced with.

Tolerance: 3 SGD steps in fp32; relative error ``||a - b|| / max(||b||, 1e-3)``
(``slapo.verify``) of the loss, the output and every parameter's gradient at most 1e-5.
"""

import copy
import warnings

import pytest
import torch
import torch.fx as fx
from static_models import (
    EXAMPLE,
    RUN,
    STEPS,
    assert_trains_alike,
    bert_config,
    blocks,
    gpt_neo_config,
    hidden,
    llama_config,
    square_loss,
)
from torch import nn

import slapo
from slapo.tracing import TraceError
from slapo.verify import train_side_by_side


def hf_loss(model, batch):
    out = model(**batch)
    return out.loss, out.logits


@pytest.mark.parametrize("flatten", [False, True], ids=["hierarchy", "flat"])
@pytest.mark.parametrize("name", list(blocks()))
def test_traced_block_trains_like_plain(name, flatten):
    factory, inputs = blocks()[name]
    torch.manual_seed(0)
    plain = factory()
    sch = slapo.create_schedule(copy.deepcopy(plain))
    sch.trace(flatten=flatten, example_inputs=inputs(*EXAMPLE, seed=100))
    assert isinstance(sch.mod, fx.GraphModule)
    batches = [inputs(*RUN, seed=s) for s in range(STEPS)]
    scheduled = slapo.build_module(sch)
    assert_trains_alike(train_side_by_side(plain, scheduled, batches, square_loss), name)


def test_hierarchy_kept_and_tree_rebuilt():
    from transformers.models.bert.modeling_bert import BertLayer
    _, inputs = blocks()["bert.BertLayer"]
    config = bert_config()
    plain = BertLayer(config)
    sch = slapo.create_schedule(copy.deepcopy(plain))
    sch.trace(example_inputs=inputs(*EXAMPLE, seed=0))
    attn = sch["attention.self"]
    assert isinstance(attn.mod, fx.GraphModule)
    assert attn.mod.config.hidden_size == config.hidden_size  # plain attributes are kept
    assert sch["attention.self.query"].mod is sch.mod.attention.self.query
    assert isinstance(sch["attention.self.query"].mod, nn.Linear)
    assert [n for n, _ in sch.mod.named_parameters()] == [n for n, _ in plain.named_parameters()]
    calls = [n.target for n in sch.mod.graph.nodes if n.op == "call_module"]
    assert calls == ["attention", "intermediate", "output"]
    # The tree is usable below the traced node: shard a Linear inside it (world size 1).
    sch["attention.self.query"].shard("weight", axis=0)


def test_flatten_and_leaves():
    from transformers.models.bert.modeling_bert import BertLayer, BertSelfAttention
    _, inputs = blocks()["bert.BertLayer"]
    sch = slapo.create_schedule(BertLayer(bert_config()))
    sch.trace(flatten=True, leaves=[BertSelfAttention, "output"],
              example_inputs=inputs(*EXAMPLE, seed=0))
    calls = [n.target for n in sch.mod.graph.nodes if n.op == "call_module"]
    assert calls == ["attention.self", "attention.output.dense", "attention.output.dropout",
                     "attention.output.LayerNorm", "intermediate.dense", "output"]
    # The graph calls the modules inside its children: those have no schedule nodes (as
    # upstream refuses them), and get_module reaches them.
    assert type(sch.get_module("attention.self")) is BertSelfAttention
    with pytest.raises(KeyError, match=r"flatten=True.*get_module\('attention.self'\)"):
        sch["attention.self"]


def test_flatten_inlines_the_children_whatever_recursive_says():
    """As upstream: ``recursive=False`` keeps the children as calls only without ``flatten``
    (upstream's autoshard tests trace a layer with both and expect its linears)."""
    from transformers.models.bert.modeling_bert import BertLayer
    _, inputs = blocks()["bert.BertLayer"]
    flat = slapo.create_schedule(BertLayer(bert_config()))
    flat.trace(recursive=False, flatten=True, example_inputs=inputs(*EXAMPLE, seed=0))
    calls = [n.target for n in flat.mod.graph.nodes if n.op == "call_module"]
    assert "attention.self.query" in calls and "output.dense" in calls
    kept = slapo.create_schedule(BertLayer(bert_config()))
    kept.trace(recursive=False, example_inputs=inputs(*EXAMPLE, seed=0))
    calls = [n.target for n in kept.mod.graph.nodes if n.op == "call_module"]
    assert calls == ["attention", "intermediate", "output"]


def test_whole_bert_model_trains_like_plain():
    from transformers import BertForMaskedLM
    config = bert_config()
    torch.manual_seed(0)
    plain = BertForMaskedLM(config)

    def batch(step, b=RUN[0], s=RUN[1]):
        gen = torch.Generator().manual_seed(step)
        mask = torch.ones(b, s, dtype=torch.long)
        mask[0, -2:] = 0
        return {"input_ids": torch.randint(0, config.vocab_size, (b, s), generator=gen),
                "attention_mask": mask,
                "labels": torch.randint(0, config.vocab_size, (b, s), generator=gen)}

    sch = slapo.create_schedule(copy.deepcopy(plain))
    sch.trace(example_inputs=batch(9, *EXAMPLE), concrete_args={"use_cache": False})
    assert isinstance(sch["bert.encoder.layer.1.attention"].mod, fx.GraphModule)
    batches = [batch(s) for s in range(STEPS)]
    scheduled = slapo.build_module(sch)
    assert_trains_alike(train_side_by_side(plain, scheduled, batches, hf_loss), "bert")


def test_whole_llama_model_flat_trains_like_plain():
    from transformers import LlamaForCausalLM
    config = llama_config()
    torch.manual_seed(0)
    plain = LlamaForCausalLM(config)

    def batch(step, b=RUN[0], s=RUN[1]):
        ids = torch.randint(0, config.vocab_size, (b, s),
                            generator=torch.Generator().manual_seed(step))
        return {"input_ids": ids, "labels": ids}

    sch = slapo.create_schedule(copy.deepcopy(plain))
    sch.trace(flatten=True, example_inputs=batch(9, *EXAMPLE),
              concrete_args={"use_cache": False})
    assert all(not isinstance(m, fx.GraphModule) for m in sch.mod.children())
    batches = [batch(s) for s in range(STEPS)]
    scheduled = slapo.build_module(sch)
    assert_trains_alike(train_side_by_side(plain, scheduled, batches, hf_loss), "llama")


# --- errors, and submodules kept whole ----------------------------------------------------
def test_untraceable_model_error_names_module_and_reason():
    from transformers import GPTNeoForCausalLM
    sch = slapo.create_schedule(GPTNeoForCausalLM(gpt_neo_config()))
    ids = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(TraceError) as err:  # builds a DynamicCache: not a graph value
        sch["transformer"].trace(example_inputs={"input_ids": ids})
    message = str(err.value)
    assert "cannot trace 'transformer' (GPTNeoModel)" in message
    assert "DynamicCache" in message and "use_cache" in message
    assert err.value.path == "transformer" and err.value.module_class == "GPTNeoModel"
    assert type(sch["transformer"].mod).__name__ == "GPTNeoModel"  # left as it was


def test_untraceable_submodule_stays_whole_with_a_warning():
    # Upstream Slapo's tracer: a submodule that cannot be traced stays one call in its
    # parent's graph; the warning names it and says why.
    from transformers import GPTNeoForCausalLM
    model = GPTNeoForCausalLM(gpt_neo_config()).eval()
    sch = slapo.create_schedule(copy.deepcopy(model))
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    with pytest.warns(UserWarning, match=r"trace kept 'transformer' \(GPTNeoModel\) whole.*"
                                         r"DynamicCache.*use_cache"):
        sch.trace(example_inputs={"input_ids": ids})
    assert isinstance(sch.mod, fx.GraphModule)
    assert type(sch["transformer"].mod).__name__ == "GPTNeoModel"
    assert "transformer" in [n.target for n in sch.mod.graph.nodes if n.op == "call_module"]
    with torch.no_grad():
        assert torch.equal(sch.mod(input_ids=ids).logits, model(input_ids=ids).logits)


class _Gate(nn.Module):
    def forward(self, x):
        return x if x.sum() > 0 else -x


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.gate = _Gate()

    def forward(self, x):
        return self.gate(self.proj(x))


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = _Block()

    def forward(self, x):
        return self.block(x)


def test_data_dependent_control_flow_error_names_module():
    sch = slapo.create_schedule(_Outer())
    # _Gate has no parameters, so it is traced into its caller, whose trace fails on it.
    with pytest.raises(TraceError, match=r"cannot trace 'block\.gate' \(_Gate\).*control flow "
                                         r"depends on the data"):
        sch["block"].trace(example_inputs=(torch.randn(2, 4),))
    # From the root, the block stays whole, and the warning says why.
    with pytest.warns(UserWarning, match=r"trace kept 'block' \(_Block\) whole.*"
                                         r"cannot trace 'block\.gate'"):
        sch.trace(example_inputs=(torch.randn(2, 4),))
    assert isinstance(sch["block"].mod, _Block)
    # Making it a leaf gets past it: the block is traced, without a warning.
    sch = slapo.create_schedule(_Outer())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sch.trace(leaves=[_Gate], example_inputs=(torch.randn(2, 4),))
    assert isinstance(sch["block"].mod, fx.GraphModule)
    x = torch.randn(2, 4)
    assert torch.equal(sch.mod(x), sch.mod.block.gate(sch.mod.block.proj(x)))


class _Pre(nn.Module):  # its forward compares a torch.Size with an int: fx cannot trace it
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        if x.size() > 0:
            return self.linear(x)
        return x


class _Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = _Pre()
        self.layers = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.post = nn.Sequential(nn.Linear(4, 4), nn.ReLU())

    def forward(self, x):
        return self.post(self.layers(self.pre(x)))


def test_trace_until_keeps_an_untraceable_sibling_whole():
    # upstream's newest test_pipeline_partition: the root and 'layers' are traced, 'pre'
    # stays its module, 'post' is traced, and stages can be cut between the layers
    sch = slapo.create_schedule(_Stack())
    with pytest.warns(UserWarning, match=r"trace kept 'pre' \(_Pre\) whole"):
        sch.trace_until("layers")
    assert isinstance(sch.mod, fx.GraphModule)
    assert isinstance(sch["pre"].mod, _Pre)
    assert isinstance(sch["layers"].mod, fx.GraphModule)
    assert isinstance(sch["post"].mod, fx.GraphModule)
    with pytest.raises(ValueError, match=r"cannot cut the pipeline after 'pre.linear'.*'pre' "
                                         r"\(_Pre\) around it was kept whole by trace, which "
                                         r"could not trace it: cannot trace 'pre'"):
        sch["pre.linear"].cut_pipeline_stage()
    sch["layers.0"].cut_pipeline_stage()
    from slapo.pipeline import generate_pipeline_partition
    sch = generate_pipeline_partition(sch)
    assert isinstance(sch["submod_0.pre"].mod, _Pre)
    assert isinstance(sch["submod_1.post"].mod, fx.GraphModule)


def test_shapes_need_example_inputs():
    class Heads(torch.nn.Module):  # no transformers config to make examples from
        def forward(self, x):
            return x.view(*x.shape[:-1], -1, 4)

    with pytest.raises(TraceError, match="pass example_inputs"):
        slapo.create_schedule(Heads()).trace()


def test_fixed_arguments_are_checked_at_call_time():
    from static_models import opt_config
    from transformers.models.opt.modeling_opt import OPTAttention
    _, inputs = blocks()["opt.OPTAttention"]
    sch = slapo.create_schedule(OPTAttention(opt_config(), layer_idx=0))
    sch.trace(example_inputs=inputs(*EXAMPLE, seed=0))
    batch = inputs(*RUN, seed=1)
    sch.mod(**batch, output_attentions=False)          # the traced value: fine
    with pytest.raises(ValueError, match="'output_attentions' fixed to False"):
        sch.mod(**batch, output_attentions=True)
    with pytest.raises(ValueError, match="takes a tensor for 'hidden_states'"):
        sch.mod(None, attention_mask=batch["attention_mask"])


def test_trace_keeps_syncs_and_refuses_a_replaced_forward():
    from transformers.models.bert.modeling_bert import BertIntermediate
    plain = BertIntermediate(bert_config())
    sch = slapo.create_schedule(copy.deepcopy(plain))
    sch.sync("fwd_pre", lambda t: t * 3)  # a tensor function on the input
    sch.sync("fwd_post", lambda t: t + 1)  # ... and on the output
    sch.trace()
    x = hidden(3, 5, 0)
    torch.testing.assert_close(sch.mod(x), plain(x * 3) + 1, rtol=0, atol=0)
    sch = slapo.create_schedule(copy.deepcopy(plain))
    sch.checkpoint()
    with pytest.raises(ValueError, match="forward replaced by an earlier primitive"):
        sch.trace()


def test_a_sync_on_a_module_a_flattening_trace_inlined_is_refused():
    """After trace(flatten=True) a child's parameters are read by the graph and the child is
    never called, so a hook on it would never run: upstream's BERT order (fuse bias+GeLU,
    then shard the FFN and sync its input gradient) trained with wrong gradients on 2 ranks,
    silently. Synced before the trace, the child stays a call and the sync runs; a module
    inside a leaf of a traced graph runs too."""
    from transformers.models.bert.modeling_bert import BertIntermediate, BertLayer
    sch = slapo.create_schedule(BertIntermediate(bert_config()))
    sch["dense"].decompose()
    sch.trace(flatten=True)
    with pytest.raises(ValueError, match="sync at 'dense': the graph of '<root>' does not call "
                                         r"'dense' \(its trace inlined it\)"):
        sch["dense"].sync("bwd_post", "all_reduce")
    plain = BertIntermediate(bert_config())
    sch = slapo.create_schedule(copy.deepcopy(plain))
    seen = []
    sch["dense"].sync("bwd_post", lambda grad: seen.append(grad.shape) or grad)
    sch["dense"].decompose()
    sch.trace(flatten=True)
    x = hidden(3, 5, 0).requires_grad_()
    sch.mod(x).sum().backward()
    assert seen == [x.shape]  # the sync ran
    from static_models import additive_mask
    layer = slapo.create_schedule(BertLayer(bert_config()))
    layer.trace(leaves=["BertIntermediate"],  # a leaf: its children run inside its call
                example_inputs={"hidden_states": hidden(*EXAMPLE, 0),
                                "attention_mask": additive_mask(*EXAMPLE, 0)})
    assert isinstance(layer.mod, fx.GraphModule)
    layer["intermediate.dense"].sync("bwd_post", "all_reduce")


def test_trace_without_example_inputs_for_simple_blocks():
    from transformers.models.bert.modeling_bert import BertIntermediate
    plain = BertIntermediate(bert_config())
    sch = slapo.create_schedule(copy.deepcopy(plain))
    sch.trace()
    x = hidden(3, 5, 0)
    torch.testing.assert_close(sch.mod(x), plain(x), rtol=0, atol=0)


def test_traced_layer_draws_the_same_dropout_masks():
    from static_models import additive_mask
    from transformers.models.bert.modeling_bert import BertLayer
    torch.manual_seed(0)
    plain = BertLayer(bert_config(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1))
    sch = slapo.create_schedule(copy.deepcopy(plain))
    torch.manual_seed(5)
    sch.trace(example_inputs={"hidden_states": hidden(*EXAMPLE, 0),
                              "attention_mask": additive_mask(*EXAMPLE, 0)})
    after_trace = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(after_trace, torch.rand(3))  # tracing does not consume random numbers
    x, mask = hidden(*RUN, 1), additive_mask(*RUN, 1)
    torch.manual_seed(7)
    expected = plain(x, mask)
    torch.manual_seed(7)
    assert torch.equal(sch.mod(x, mask), expected)


class _FunctionalDropouts(nn.Module):
    """Dropout as transformers writes it: its switch and its rate from ``self.training``."""

    def forward(self, x):
        x = torch.nn.functional.dropout(x, p=0.5, training=self.training)
        rate = 0.5 if self.training else 0.0
        return torch.nn.functional.scaled_dot_product_attention(x, x, x, dropout_p=rate)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_a_layer_traced_in_train_mode_stops_dropping_out_in_eval_mode(attn):
    # transformers' attention computes its dropout from self.training, which a trace fixes
    from static_models import additive_mask
    from transformers.models.bert.modeling_bert import BertLayer
    torch.manual_seed(0)
    config = bert_config(attention_probs_dropout_prob=0.5, attn_implementation=attn)
    plain = BertLayer(config)
    sch = slapo.create_schedule(copy.deepcopy(plain))
    sch.trace(flatten=True, example_inputs={"hidden_states": hidden(*EXAMPLE, 0),
                                            "attention_mask": additive_mask(*EXAMPLE, 0)})
    x, mask = hidden(*RUN, 1), additive_mask(*RUN, 1)
    sch.mod.eval(), plain.eval()
    torch.testing.assert_close(sch.mod(x, mask)[0], plain(x, mask)[0], rtol=1e-5, atol=1e-6)
    sch.mod.train(), plain.train()
    torch.manual_seed(7)
    expected = plain(x, mask)[0]
    torch.manual_seed(7)
    assert torch.equal(sch.mod(x, mask)[0], expected)  # the same masks, drawn in train mode
    assert not torch.equal(sch.mod(x, mask)[0], expected)


def test_functional_dropout_follows_the_mode_the_traced_module_runs_in():
    torch.manual_seed(0)
    x = torch.rand(2, 4, 8)
    sch = slapo.create_schedule(_FunctionalDropouts())
    sch.trace(example_inputs=[x])
    assert sum(n.op == "get_attr" and n.target == "training" for n in sch.mod.graph.nodes) == 1
    sch.mod.eval()
    expected = torch.nn.functional.scaled_dot_product_attention(x, x, x)
    assert torch.equal(sch.mod(x), expected)
    sch.mod.train()
    torch.manual_seed(3)
    dropped = sch.mod(x)
    torch.manual_seed(3)
    assert torch.equal(dropped, _FunctionalDropouts()(x))
    assert not torch.allclose(dropped, expected)
    # traced in eval mode, the graph keeps what the module computed then
    sch = slapo.create_schedule(_FunctionalDropouts().eval())
    sch.trace(example_inputs=[x])
    assert not any(n.op == "get_attr" for n in sch.mod.graph.nodes)
