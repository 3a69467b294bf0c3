"""What upstream Slapo's code reads from the package, beyond the primitives: the pipeline's
tie analyses, the framework dialects, the memory report, the RNG tracker's contract, the
GPT-2 embedding hooks. One process; the collectives are in tests/distributed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import slapo
import slapo.pipeline


class _Stage0(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(10, 10)
        self.linear = nn.Linear(10, 10, bias=False)


class _StageN(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(10, 10, bias=False)


def _tied(stages: int) -> nn.Module:
    model = nn.Module()
    model.first = _Stage0()
    for k in range(1, stages):
        setattr(model, f"after{k}", _StageN())
        getattr(model, f"after{k}").linear.weight = model.first.wte.weight
    return model


class _Topo:
    """The three degrees a topology reports (DeepSpeed's axis names)."""

    def __init__(self, dp, pp, tp):
        self.dims = {"data": dp, "pipe": pp, "model": tp}

    def get_dim(self, axis):
        return self.dims[axis]


def test_analyze_tie_weights_names_each_holder_with_its_stage():
    model = _tied(3)
    model.after2.extra = nn.Linear(2, 2)  # untied parameters are not listed
    groups = slapo.pipeline.analyze_tie_weights(model)
    assert groups == [[("first.wte.weight", 0), ("after1.linear.weight", 1),
                       ("after2.linear.weight", 2)]]
    assert slapo.pipeline.analyze_tie_weights(nn.Sequential(nn.Linear(2, 2))) == []


def test_analyze_tie_weights_in_upstreams_later_form_maps_each_tied_parameter():
    """Upstream's later ``analyze_tie_weights(model, is_pipeline_partitioned)``: a dict from
    each tied parameter to its holders, named within their stage when partitioned, by their
    full path with stage 0 when not (where a tie inside one stage counts too)."""
    model = _tied(3)
    model.first.twin = nn.Linear(10, 10, bias=False)
    model.first.twin.weight = model.first.linear.weight  # tied inside one stage
    shared = model.first.wte.weight
    assert slapo.pipeline.analyze_tie_weights(model, True) == {
        shared: [("wte.weight", 0), ("linear.weight", 1), ("linear.weight", 2)]}
    whole = slapo.pipeline.analyze_tie_weights(model, False)
    assert list(whole) == [shared, model.first.linear.weight]
    assert whole[shared] == [("first.wte.weight", 0), ("after1.linear.weight", 0),
                             ("after2.linear.weight", 0)]
    assert whole[model.first.linear.weight] == [("first.linear.weight", 0),
                                                ("first.twin.weight", 0)]
    # its values are groups that analyze_tie_ranks takes, as upstream's scripts passed them
    groups = list(slapo.pipeline.analyze_tie_weights(_tied(2), True).values())
    assert slapo.pipeline.analyze_tie_ranks(groups, _Topo(dp=1, pp=2, tp=2)) == \
        [[[0, 2], [1, 3]]]


def test_analyze_tie_ranks_pairs_the_same_position_of_each_stage():
    groups = slapo.pipeline.analyze_tie_weights(_tied(2))
    assert slapo.pipeline.analyze_tie_ranks(groups, _Topo(dp=1, pp=2, tp=1)) == [[[0, 1]]]
    # pipe x data x tensor = 2 x 2 x 2: stage 0 holds ranks 0-3, stage 1 ranks 4-7
    assert slapo.pipeline.analyze_tie_ranks(groups, _Topo(dp=2, pp=2, tp=2)) == \
        [[[0, 4], [1, 5], [2, 6], [3, 7]]]
    with pytest.raises(ValueError, match="held by stage 1, but the topology has 1 stages"):
        slapo.pipeline.analyze_tie_ranks(groups, _Topo(dp=2, pp=1, tp=1))


def test_the_deepspeed_dialects_analyze_tie_ranks_gives_ranks_and_stages():
    """Upstream's DeepSpeed dialect form, ``(tie_ranks, tie_stages)``, from DeepSpeed's own
    topology (``filter_match``) or ours, for upstream's later ``analyze_tie_weights`` groups:
    4 stages x 2 tensor ranks, the embedding tied from stage 0 to 3, a layer from 1 to 2."""
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    from slapo.framework_dialect.deepspeed.pipeline import analyze_tie_ranks

    model = nn.Module()
    model.first, model.second, model.third, model.fourth = \
        _Stage0(), _StageN(), _StageN(), _StageN()
    model.fourth.linear.weight = model.first.wte.weight
    model.third.linear.weight = model.second.linear.weight
    groups = list(slapo.pipeline.analyze_tie_weights(model, True).values())
    expected = ([[[0, 6], [1, 7]], [[2, 4], [3, 5]]], [[0, 3], [1, 2]])
    topology = PipeModelDataParallelTopology(num_pp=4, num_mp=2, num_dp=1)
    assert analyze_tie_ranks(groups, topology) == expected
    assert analyze_tie_ranks(groups, _Topo(dp=1, pp=4, tp=2)) == expected


def test_model_dialect_is_upstreams_other_name_for_the_framework_dialects():
    import importlib

    pipeline = importlib.import_module("slapo.model_dialect.deepspeed.pipeline")
    assert pipeline is slapo.framework_dialect.deepspeed.pipeline
    assert slapo.model_dialect.get_dialect_cls is slapo.framework_dialect.get_dialect_cls
    assert slapo.model_dialect.deepspeed.pipeline.analyze_tie_ranks is pipeline.analyze_tie_ranks


def test_pipeline_keeps_upstream_names_over_its_two_modules():
    from slapo.pipeline import partition, runtime
    assert slapo.pipeline.split_stages is partition.split_stages
    assert slapo.pipeline.generate_pipeline_partition is partition.generate_pipeline_partition
    assert slapo.pipeline.build_pipeline is runtime.build_pipeline
    assert slapo.pipeline.analyze_tie_weights is runtime.analyze_tie_weights


def test_rng_tracker_keeps_megatron_contract():
    from slapo.random import CudaRNGStatesTracker, model_parallel_cuda_manual_seed
    tracker = CudaRNGStatesTracker()
    tracker.set_states({"given": 1234})  # stored as given, read back in the same form
    assert tracker.get_states() == {"given": 1234}
    tracker.reset()
    tracker.add("dropout", 1111)
    with pytest.raises(ValueError, match="seeds another random stream"):
        tracker.add("other", 1111)
    with pytest.raises(ValueError, match="exists already"):
        tracker.add("dropout", 7)
    torch.manual_seed(1111)  # a stream's state is its generator's, seeded alike
    assert torch.equal(tracker.get_states()["dropout"], torch.get_rng_state())
    torch.manual_seed(5)
    with tracker.fork("dropout"):
        first = torch.rand(3)
        assert torch.initial_seed() == 1111
    assert torch.initial_seed() == 5
    with tracker.fork("dropout"):
        assert not torch.equal(torch.rand(3), first)  # the stream went on
    # seeding again starts the per-rank stream anew instead of failing
    assert model_parallel_cuda_manual_seed(123, tp_rank=1) == 123 + 2718 + 1
    assert model_parallel_cuda_manual_seed(123, tp_rank=1) == 123 + 2718 + 1
    with slapo.get_cuda_rng_tracker().fork():
        assert torch.initial_seed() == 123 + 2718 + 1
    assert torch.initial_seed() == 123


def test_set_random_seed_takes_upstreams_positional_ranks():
    assert slapo.set_random_seed(123, None, None, 0) == 123  # (seed, dp, pp, tp) as upstream
    assert slapo.set_random_seed(123, 1, 2, None) == 123 + 200 + 10


def test_framework_dialects_by_kind_and_target(tmp_path):
    from slapo.framework_dialect import get_all_dialects, get_dialect_cls
    from slapo.framework_dialect.deepspeed.pipeline import get_ds_config

    model = nn.Linear(2, 2)
    assert get_dialect_cls("runtime_engine", None)(model) == (model, None)
    assert get_dialect_cls("runtime_engine", "nope", allow_none=True)(model) == (model, None)
    assert {None, "deepspeed"} <= set(get_all_dialects("runtime_engine"))
    with pytest.raises(ValueError, match="no log_parser dialect for 'nope'"):
        get_dialect_cls("log_parser", "nope")
    with pytest.raises(ValueError, match=r"target='pipeline', topology=slapo.Topology"):
        get_dialect_cls("pipeline_engine", "deepspeed")
    with pytest.raises(ValueError, match="unknown dialect kind"):
        get_dialect_cls("optimizer", "deepspeed")
    config = get_ds_config(batch_size=8, micro_batch_size_per_gpu=2, fp16=False, zero_stage=3)
    assert config["train_batch_size"] == 8 and config["zero_optimization"]["stage"] == 3
    assert not config["fp16"]["enabled"] and "zero_optimization" not in get_ds_config(8, 2)


def test_log_parsers_read_throughput_memory_and_failures(tmp_path):
    from slapo.framework_dialect import get_dialect_cls

    megatron = tmp_path / "megatron.log"
    megatron.write_text(
        "parameters on (tensor, pipeline) model parallel rank (0, 0): 1234\n"
        "iteration 5 | global batch size: 16 | elapsed time per iteration (ms): 900.0\n"
        "iteration 10 | global batch size: 16 | elapsed time per iteration (ms): 400.0\n"
        "iteration 15 | global batch size: 16 | elapsed time per iteration (ms): 600.0\n"
        "[Rank 0] (after 15 iterations) memory (MB) | max allocated: 2048.0\n")
    params, throughput, memory, code = get_dialect_cls("log_parser", "megatron").parse_log(megatron)
    assert (params, code) == (1234, 0)
    assert throughput == pytest.approx(16 / 0.5) and memory == pytest.approx(2.048)

    deepspeed = tmp_path / "deepspeed.log"
    # running means over equal intervals of 40 samples: 1 s, then 0.5 s, then 0.5 s
    deepspeed.write_text("RunningAvgSamplesPerSec=40.0, MaxMemAllocated=1.5GB\n"
                         "RunningAvgSamplesPerSec=53.333, MaxMemAllocated=1.5GB\n"
                         "RunningAvgSamplesPerSec=60.0, MaxMemAllocated=2.5GB\n")
    _, throughput, memory, code = get_dialect_cls("log_parser", "deepspeed").parse_log(deepspeed)
    assert code == 0 and throughput == pytest.approx(80.0, rel=1e-4) and memory == 2.5

    oom, empty = tmp_path / "oom.log", tmp_path / "empty.log"
    oom.write_text("torch.OutOfMemoryError: CUDA out of memory.")
    empty.write_text("Traceback: something else\n")
    for target in ("megatron", "deepspeed"):
        parser = get_dialect_cls("log_parser", target)
        assert parser.parse_log(oom)[3] == 1 and parser.parse_log(empty) == (0, 0, 0, 2)


def test_build_runs_registered_runtime_engines():
    from slapo.framework_dialect import _DIALECTS, register_framework_dialect

    @register_framework_dialect("toy", "runtime_engine")
    def toy(model, lr=None):
        return model, ("toy-optimizer", lr)
    try:
        sch = slapo.create_schedule(nn.Linear(2, 2))
        model, opt = slapo.build(sch, target="toy", init_weights=False, lr=0.5)
        assert model is sch.mod and opt == ("toy-optimizer", 0.5)
        with pytest.raises(ValueError, match="unknown build target 'nope'"):
            slapo.build(sch, target="nope")
    finally:
        del _DIALECTS["runtime_engine"]["toy"]


def test_report_memory_reports_this_process(capsys):
    from slapo.utils.report import report_memory

    keep = torch.ones(1000)
    report = report_memory("after init", report_gc=True)
    assert report["cpu_peak_gib"] > 0 and report["gc_tensor_elements"] >= keep.numel()
    assert "after init rank 0: CPU peak resident memory" in capsys.readouterr().out


def test_import_slapo_keeps_frameworks_out():
    import subprocess
    import sys
    code = ("import sys, slapo, slapo.framework_dialect.deepspeed.pipeline; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'deepspeed', 'megatron'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_import_slapo_reaches_the_subpackages_upstreams_tutorials_use():
    # upstream's tutorials call slapo.op.Print() and slapo.env.setup(...) after a bare
    # `import slapo`; a fresh interpreter, so that no other test's import makes it pass
    import subprocess
    import sys
    code = ("import slapo; "
            "print(slapo.op.Print.__name__, slapo.env.setup.__name__, "
            "slapo.tracer.trace.__name__, slapo.model_schedule.apply_schedule.__name__, "
            "slapo.initialization.init_empty_weights.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.split() == ["Print", "setup", "trace", "apply_schedule", "init_empty_weights"]


def test_flash_attention_matches_gpt2_attention_within_upstreams_tolerance():
    """slapo.op.FlashAttention against transformers' GPT2Attention, as upstream's op test
    compares them (fused q, k, v interleaved per head; tolerance 5e-2). transformers 5 leaves
    the causal mask to the model, so the reference gets it in its mask, as transformers 4's
    attention applied it."""
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    from slapo import op

    batch, seq, hidden, heads = 2, 32, 64, 4
    config = GPT2Config(n_embd=hidden, n_head=heads, n_positions=seq, attn_pdrop=0.0,
                        resid_pdrop=0.0)
    torch.manual_seed(0)
    ref = GPT2Attention(config)
    attn = op.FlashAttention(hidden_size=hidden, num_attention_heads=heads, output_proj=True,
                             attn_pdrop=0.0, resid_pdrop=0.0, attn_op_name="cuda",
                             fused_qkv=True)
    # GPT-2's Conv1D holds q, k, v side by side; FlashAttention interleaves them per head
    qkv = ref.c_attn.weight.detach().t().reshape(3, heads, hidden // heads, hidden)
    attn.qkv.weight = nn.Parameter(qkv.transpose(0, 1).reshape(3 * hidden, hidden).clone())
    attn.qkv.bias = nn.Parameter(ref.c_attn.bias.detach().reshape(3, heads, -1)
                                 .transpose(0, 1).reshape(-1).clone())
    attn.out_proj.weight = nn.Parameter(ref.c_proj.weight.detach().t().contiguous())
    attn.out_proj.bias = nn.Parameter(ref.c_proj.bias.detach().clone())
    x = torch.randn(batch, seq, hidden, requires_grad=True)
    mask = torch.randn(batch, 1, 1, seq)
    causal = torch.full((seq, seq), float("-inf")).triu(1)
    out_ref = ref(x, None, mask + causal)[0]
    (grad_ref,) = torch.autograd.grad(out_ref.sum(), x)
    out = attn(x, mask, None)[0]
    (grad,) = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(out, out_ref, atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(grad, grad_ref, atol=5e-2, rtol=5e-2)
    # without the causal mask the two differ: the reference changed, not the op
    assert not torch.allclose(attn(x, mask, None)[0], ref(x, None, mask)[0], atol=5e-2)


def test_verify_of_a_pipeline_refuses_what_it_cannot_check():
    # the pipeline check itself runs on gloo ranks: tests/distributed/test_verify_pipeline.py
    sch = slapo.create_schedule(nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"topology= takes a slapo.Topology, got object"):
        slapo.Verify(sch, [torch.ones(1, 2)], topology=object(), config={})
    with pytest.raises(TypeError, match=r"config= takes a DeepSpeed config dict, got str"):
        slapo.Verify(sch, [torch.ones(1, 2)], config="ds.json")
    for key in ("fp16", "bf16"):
        with pytest.raises(ValueError, match=rf"the config enables {key}.*checks? .*float32"):
            slapo.Verify(sch, [torch.ones(1, 2)], config={key: {"enabled": True}})
    with pytest.raises(ValueError, match=r"a schedule that cuts pipeline stages"):
        with slapo.Verify(sch, [torch.ones(1, 2)], config={"train_batch_size": 2}):
            pass



def test_verify_leaves_the_random_state_as_it_found_it():
    # the check seeds torch to run both models alike; the caller's stream goes on unchanged
    sch = slapo.create_schedule(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)))
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    with slapo.Verify(sch, [torch.ones(2, 4)], eval_mode=False):
        pass
    assert torch.equal(torch.rand(3), expected)


# -- upstream's schedules, as a probe of them found them failing (2026-12-05) ----------------
UPSTREAM_ATTN_CONCRETE = {"layer_past": None, "head_mask": None, "encoder_hidden_states": None,
                          "encoder_attention_mask": None, "use_cache": False,
                          "output_attentions": False}


def test_upstream_traces_flash_attention_with_its_op_a_leaf_and_subclasses_the_op():
    import copy

    from slapo.op import FlashAttention, FlashAttentionOp

    torch.manual_seed(0)
    plain = FlashAttention(64, 4, fused_qkv=True)
    sch = slapo.create_schedule(copy.deepcopy(plain))
    # upstream's gpt_neo.py / bert.py: no example inputs, the op kept a leaf
    sch.trace(tracer="pytorch", leaf_modules=["FlashAttentionOp"],
              concrete_args=UPSTREAM_ATTN_CONCRETE)
    op = sch["attn_op"].mod
    assert isinstance(op, FlashAttentionOp) and op.apply_causal_mask is True

    class AttentionOpWithRNG(FlashAttentionOp):  # upstream's subclass, its call and fields
        def forward(self, query_layer, key_layer, value_layer, attention_mask, p):
            return super().forward(query_layer, key_layer, value_layer, attention_mask, p)

    sch["attn_op"].replace(AttentionOpWithRNG(op.attn_op_name, op.apply_causal_mask, op.scale))
    x = torch.randn(2, 8, 64)
    torch.testing.assert_close(sch.mod(x, None)[0], plain(x)[0], rtol=1e-5, atol=1e-6)
    # fix_attention_mask_shape looks for an expand to fix: there is none, and that is no error
    assert sch.find_node(lambda n: n.op == "call_method" and n.target == "expand") == []
    from slapo.op.attention import FlashAttentionOp as at_upstreams_path

    assert at_upstreams_path is FlashAttentionOp and callable(slapo.op.attention)


def test_checkpoint_orders_the_call_as_upstreams_order_args_fn_says():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, scale=1.0, use_cache=True):
            assert use_cache is False, "order_args_fn drops use_cache"
            return self.lin(x) * scale

    torch.manual_seed(0)
    sch = slapo.create_schedule(Scaled())
    sch.checkpoint(order_args_fn=lambda *args, **kwargs: (args[0], kwargs["scale"], False))
    x = torch.randn(3, 4, requires_grad=True)
    out = sch.mod(x, scale=2.0, use_cache=True)
    torch.testing.assert_close(out, sch.mod.lin(x) * 2.0)
    out.sum().backward()
    assert x.grad is not None
    with pytest.raises(TypeError, match="order_args_fn must be callable"):
        sch.checkpoint(order_args_fn="positional")


def test_trace_for_pipeline_is_upstreams_name_for_trace_until():
    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    sch = slapo.create_schedule(Stack())
    assert sch.trace_for_pipeline("layers", example_inputs=(torch.randn(2, 4),))
    sch["layers.0"].cut_pipeline_stage()


class _LinearReLU(nn.Module):
    """A layer of the trace_until tests: a Linear and a ReLU, called as one module."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.fc(x))


def test_trace_until_the_root_keeps_its_children_as_calls():
    """Upstream's pipeline tests trace until "" (the root): its children are the stops. (The
    stops were named ".pre", ".blocks.0", which matched nothing: all was traced through.)"""
    from slapo.tracing import is_traced

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.pre = _LinearReLU()
            self.blocks = nn.ModuleList(_LinearReLU() for _ in range(2))

        def forward(self, x):
            x = self.pre(x)
            for block in self.blocks:
                x = block(x)
            return x

    sch = slapo.create_schedule(Net())
    sch.trace_until("", example_inputs=(torch.randn(2, 4),))
    calls = [n.target for n in sch.mod.graph.nodes if n.op == "call_module"]
    assert calls == ["pre", "blocks.0", "blocks.1"]
    assert not any(is_traced(sch[path].mod) for path in calls)


def test_upstream_seeding_keywords_and_check():
    from slapo.op import FlashAttention
    from slapo.random import get_cuda_rng_tracker, is_random_seed_set

    get_cuda_rng_tracker().reset()
    assert not is_random_seed_set()
    assert slapo.set_random_seed(7, always_enable_tp_seed=True) == 7  # no tp_rank: rank 0's
    assert is_random_seed_set()
    get_cuda_rng_tracker().reset()
    FlashAttention(64, 4, world_size=2)  # an older upstream's argument, taken


def test_upstreams_top_level_names():
    # upstream's slapo/__init__.py exported these; its scripts call them so
    assert slapo.get_logger("x").name.endswith("x")
    space = slapo.Space()
    assert isinstance(space, slapo.Space) and slapo.Symbol and slapo.Database


def test_trace_until_a_module_whose_child_is_a_list_keeps_the_lists_items():
    # upstream's trace_for_pipeline("transformer"): the layers are in transformer.h, a list
    # never called itself; they were traced through (and a kernel inside failed)
    class Body(nn.Module):
        def __init__(self):
            super().__init__()
            self.h = nn.ModuleList(_LinearReLU() for _ in range(3))

        def forward(self, x):
            for layer in self.h:
                x = layer(x)
            return x

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.transformer = Body()

        def forward(self, x, encoder_hidden_states_unused=None):
            return self.transformer(x)

    sch = slapo.create_schedule(Model())
    # a None for an argument the forward does not take fixes nothing: taken, as torch.fx did
    sch.trace_for_pipeline("transformer", example_inputs=(torch.randn(2, 4),),
                           concrete_args={"head_mask": None})
    assert not isinstance(sch["transformer.h.1"].mod, torch.fx.GraphModule)  # kept a call
    assert isinstance(sch["transformer"].mod, torch.fx.GraphModule)
    sch["transformer.h.1"].cut_pipeline_stage()
