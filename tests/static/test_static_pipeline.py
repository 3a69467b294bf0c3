"""``cut_pipeline_stage`` and the stage split, in one process: the stages of a traced BERT run
one after another compute what the model computes, each parameter lives in exactly one stage
under its original name, and misplaced cuts raise clear errors. (The 2-rank training run with
``torch.distributed.pipelining`` is in test_static_distributed.py.)
"""

import copy

import pytest
import torch
import torch.fx as fx
from static_models import pipeline_batch, pipeline_model, pipeline_schedule

import slapo
from slapo.pipeline import split_stages


def test_stages_in_sequence_compute_the_model():
    plain = pipeline_model()
    sch = pipeline_schedule(copy.deepcopy(plain),
                            cuts=("bert.encoder.layer.2", "bert.encoder.layer.0"))
    stages = split_stages(sch)
    assert len(stages) == 3
    ids, mask, _ = pipeline_batch(0)
    values = (ids, mask)
    for stage in stages:
        values = stage(*values)
        values = values if isinstance(values, tuple) else (values,)
    expected = plain(input_ids=ids, attention_mask=mask, return_dict=False)[0]
    torch.testing.assert_close(values[0], expected, rtol=1e-6, atol=1e-6)
    names = [[n for n, _ in s.named_parameters()] for s in stages]
    used = [n for n, _ in sch.mod.named_parameters()]  # the traced graphs drop unused ones
    assert sorted(sum(names, [])) == sorted(used)
    assert "bert.encoder.layer.0.attention.self.query.weight" in names[0]
    assert "bert.encoder.layer.1.output.dense.bias" in names[1]
    assert "cls.predictions.decoder.weight" in names[2]
    # The cut inside the nested graphs did not change the model itself.
    assert [n.target for n in sch.mod.graph.nodes if n.op == "call_module"] == ["bert", "cls"]


def test_cut_in_untraced_module_is_an_error():
    sch = slapo.create_schedule(pipeline_model())
    with pytest.raises(ValueError, match=r"cannot cut the pipeline after 'bert\.encoder\.layer\.1'"
                                         r" \(BertLayer\): no traced graph calls it; no ancestor "
                                         r"is traced"):
        sch["bert.encoder.layer.1"].cut_pipeline_stage()
    ids, mask, _ = pipeline_batch(0)
    sch.trace(flatten=True, example_inputs={"input_ids": ids, "attention_mask": mask},
              concrete_args={"use_cache": False})
    with pytest.raises(KeyError, match=r"inside the graph that trace\(flatten=True\) made"):
        sch["bert.encoder.layer.1"].cut_pipeline_stage()  # traced into the flat graph
    with pytest.raises(ValueError, match="applies to a submodule"):
        sch.cut_pipeline_stage()


def test_split_needs_traced_root_and_cuts():
    sch = slapo.create_schedule(pipeline_model())
    ids, mask, _ = pipeline_batch(0)
    sch["bert.encoder"].trace(example_inputs={"hidden_states": torch.randn(4, 8, 32)})
    sch["bert.encoder.layer.1"].cut_pipeline_stage()  # legal: a traced graph calls it ...
    with pytest.raises(ValueError, match="needs the traced model"):
        split_stages(sch)                              # ... but the root is not traced
    traced = pipeline_schedule(pipeline_model(), cuts=())
    with pytest.raises(ValueError, match="no pipeline cuts"):
        split_stages(traced)


def test_tied_weights_across_stages_are_an_error():
    sch = pipeline_schedule(pipeline_model(tie=True))
    with pytest.raises(ValueError, match=r"used by several stages: 'bert\.embeddings\.word_"
                                         r"embeddings\.weight' \(stage 0\), 'cls\.predictions"
                                         r"\.decoder\.weight' \(stage 1\)"):
        split_stages(sch)


def test_cut_inside_checkpointed_layer_is_an_error():
    sch = pipeline_schedule(pipeline_model(), cuts=())
    sch["bert.encoder.layer.1"].checkpoint()
    sch["bert.encoder.layer.1.attention"].cut_pipeline_stage()
    with pytest.raises(ValueError, match=r"cannot cut inside 'bert\.encoder\.layer\.1'"):
        split_stages(sch)


def test_pipeline_build_needs_distributed():
    sch = pipeline_schedule(pipeline_model())
    with pytest.raises(RuntimeError, match="needs torch.distributed initialised"):
        slapo.build(sch, target="pipeline", n_microbatches=2)
    with pytest.raises(ValueError, match="unknown build target"):
        slapo.build(sch, target="graph")
    assert isinstance(slapo.build_module(sch), fx.GraphModule)
    model, optimizer = slapo.build(sch, init_weights=False)  # upstream Slapo's contract
    assert isinstance(model, fx.GraphModule) and optimizer is None


def test_trace_until_stops_at_the_children_of_a_path():
    model = pipeline_model()
    ids, mask, _ = pipeline_batch(3, batch=2, seq=6)
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, return_dict=False)[0]
    sch = slapo.create_schedule(model)
    sch.trace_until("bert.encoder.layer",
                    example_inputs={"input_ids": ids, "attention_mask": mask},
                    concrete_args={"use_cache": False, "return_dict": False})
    assert isinstance(sch.mod, fx.GraphModule)
    assert isinstance(sch["bert.encoder"].mod, fx.GraphModule)
    layer = sch["bert.encoder.layer.0"].mod
    assert not isinstance(layer, fx.GraphModule)  # a leaf, as it was
    sch["bert.encoder.layer.1"].cut_pipeline_stage()  # the cut needs the graph above it
    with torch.no_grad():
        out = sch.mod(input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(out[0] if isinstance(out, tuple) else out, expected)
    with pytest.raises(ValueError, match="traced already"):
        sch.trace_until("bert.encoder.layer")
    with pytest.raises(ValueError, match="is not the root"):
        sch["bert"].trace_until("encoder.layer")


def test_a_vocab_parallel_loss_leaves_the_traced_root_to_the_pipeline():
    """``vocab_parallel_loss`` wraps the root's forward; tracing the root traces the model's own
    forward (the logits) and hands the loss to ``build(target="pipeline")``, which computes
    the same loss from the output; a trace that fails leaves the wrapper in place."""
    from slapo import state
    from slapo.op import vocab_parallel_loss
    from slapo_ae.zoo import build_model, synthetic_batch

    model = build_model("llama-tiny")
    sch = slapo.create_schedule(model)
    vocab_parallel_loss(sch, "causal")
    batch = synthetic_batch("llama-tiny", 2, 12, seed=3)
    expected = model(**batch).loss
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    # flatten=True: one trace, so that the failure inside the model is the root's (with the
    # hierarchy kept, the LlamaModel that cannot be traced would stay whole instead)
    with pytest.raises(Exception):  # noqa: B017 - any trace error; the wrapper must survive
        sch.trace(flatten=True, example_inputs={"no_such_input": batch["input_ids"]})
    assert "forward" in model.__dict__ and state.pipeline_loss(sch) is None
    torch.testing.assert_close(model(**batch).loss, expected)
    sch.trace(example_inputs=inputs, concrete_args={"use_cache": False, "return_dict": False})
    loss_fn = state.pipeline_loss(sch)
    assert isinstance(sch.mod, fx.GraphModule) and loss_fn is not None
    output = sch.mod(**inputs)
    torch.testing.assert_close(loss_fn(output, batch["labels"]), expected, rtol=1e-6, atol=0)


def test_a_stage_that_computes_nothing_is_an_error():
    # a cut after the model's last module made an empty last stage (a probe, 2026-12-05)
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.b(self.a(x))

    sch = slapo.create_schedule(Two())
    sch.trace(example_inputs=(torch.randn(2, 4),))
    sch["b"].cut_pipeline_stage()
    with pytest.raises(ValueError, match=r"pipeline stage 1 \(the cut after 'b'\) would compute "
                                         "nothing"):
        split_stages(sch)


def test_a_later_stage_that_embeds_its_input_is_named_before_a_pipeline_runs():
    """``build(target="pipeline")`` refuses, before any rank runs, a stage after the first that
    looks an input up in an embedding (T5's decoder stage): torch.distributed.pipelining runs
    such a stage once on uninitialised inputs (an index out of range on one rank, a closed
    connection on the others, until 2026-12-06)."""
    from slapo.model_schedule import apply_schedule
    from slapo.pipeline.partition import split_stages
    from slapo.pipeline.runtime import embedded_input
    from slapo_ae.zoo import build_model

    model = build_model("t5-tiny")
    sch = apply_schedule(model, model.config, tensor_parallel=False, pipeline_cuts=[[0], [0]])
    # the decoder's stages: inlined (its first block cut) and, below, called whole
    assert [embedded_input(s) for s in split_stages(sch, tied=True)] == \
        ["input_ids", None, "decoder_input_ids", None]
    model = build_model("t5-tiny")
    sch = apply_schedule(model, model.config, tensor_parallel=False, pipeline_cuts=[[], []])
    assert [embedded_input(s) for s in split_stages(sch, tied=True)] == \
        ["input_ids", "decoder_input_ids"]
    model = build_model("llama-tiny")
    sch = apply_schedule(model, model.config, tensor_parallel=False, pipeline_cuts=[0])
    assert [embedded_input(s) for s in split_stages(sch, tied=True)] == ["input_ids", None]
