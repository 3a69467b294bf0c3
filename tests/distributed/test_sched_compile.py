"""The CUDA kernel path of the transformer families' schedules, compiled by Inductor on CPU:
with ``compile_layers`` each layer is one ``torch.compile`` region (the ``compile`` primitive),
and the scheduled model must still train exactly as the plain model does. (WideResNet's
schedule compiles nothing: its blocks differ in shape from stage to stage, so one code object
would be compiled for every shape, and Inductor failed on BatchNorm once Dynamo made the
shapes dynamic.)

Set-up as in test_sched_tp.py: tiny configs, fp32, dropout off, 3 SGD steps on padded batches,
loss, logits and every gradient compared after each step by relative error
``||a - b|| / max(||b||, 1e-3)``. Tolerance 1e-4, not 1e-5: Inductor reassociates the fp32
sums it fuses (measured here: at most 2e-6). Two variants, both against the plain eager model:

- ``tp2``: 2 CPU ranks over gloo, tensor parallelism with the embedding sharded and
  checkpoint ratio 0.5, so that the collectives of ``sync`` (and their ``overlap``), the
  random streams of ``fork_rng`` and checkpointing all sit inside compiled layers;
- ``tp1``: one process, kernels only (Figure 9's "+ Kernel Opt", Slapo-TP on one GPU).

Dynamo must not give up on a region (``fail_on_recompile_limit_hit``): slapo's hooks run
eagerly between compiled pieces instead of being guarded on.
"""

import pytest
from distributed import run_ranks
from sched_helpers import TINY, assert_equal_training, side_by_side

from slapo import state

TOL = 1e-4
# the tiny configs' compiled modules: each layer (T5: 2 encoder and 2 decoder blocks), and
# BERT's MLM head transform; the loss is compiled too (compiled_loss), a function, not a module
REGIONS = {"bert": 3, "roberta": 2, "gpt_neo": 2, "opt": 2, "t5": 4, "llama": 2}
# the projections fused in the regions of one process (compile(fuse_projections=True)),
# as "module:linear+linear"
FUSED = {
    "bert": {"attention.self:query+key+value"},
    "roberta": {"attention.self:query+key+value"},
    "gpt_neo": {"attn.attention:q_proj+k_proj+v_proj"},
    "opt": {"self_attn:q_proj+k_proj+v_proj"},
    "t5": {"layer.0.SelfAttention:q+k+v", "layer.1.EncDecAttention:k+v"},
    "llama": {"self_attn:q_proj+k_proj+v_proj", "mlp:gate_proj+up_proj"},
}
VARIANTS = {
    "tp2": dict(tensor_parallel=True, shard_embedding=True, kernel_opt=True, ckpt_ratio=0.5,
                compile_layers=True),
    "tp1": dict(tensor_parallel=False, shard_embedding=False, kernel_opt=True, ckpt_ratio=0.0,
                compile_layers=True),
}


def _compiled_variant(variant: str) -> dict:
    import torch._dynamo
    import torch._dynamo.utils

    from slapo.primitives._projections import fused_groups

    torch._dynamo.config.fail_on_recompile_limit_hit = True
    torch.manual_seed(0)
    results = {}
    for family in REGIONS:
        name = TINY[family]
        # one model a process, as in a real run: transformers' layers share one code object
        # (their checkpointing wrapper), whose compiled entries would add up across models
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        before = len(fused_groups())
        reports, _, scheduled = side_by_side(name, **VARIANTS[variant])
        fused = {group[-1].rpartition(".")[0] + ":" + "+".join(
            path.rpartition(".")[2] for path in group) for group in fused_groups()[before:]}
        compiled = sum(state.is_compiled(m) for m in scheduled.modules())
        counters = torch._dynamo.utils.counters
        breaks = sum(counters["graph_break"].values())
        results[family] = (reports, compiled, counters["stats"]["unique_graphs"], breaks, fused)
    return results


@pytest.fixture(scope="module")
def tp2_results():
    return run_ranks(_compiled_variant, "tp2")


@pytest.fixture(scope="module")
def tp1_results():
    return _compiled_variant("tp1")




@pytest.mark.slow
@pytest.mark.parametrize("family", list(REGIONS))
def test_compiled_layers_train_as_the_plain_model_on_two_ranks(tp2_results, family):
    for rank, results in enumerate(tp2_results):
        reports, compiled, graphs, _, _ = results[family]
        assert_equal_training(reports, f"{family} tp2 rank {rank}", tol=TOL)
        assert compiled == REGIONS[family], (family, compiled)
        assert graphs > 0, f"{family}: nothing was compiled"


@pytest.mark.slow
@pytest.mark.parametrize("family", list(REGIONS))
def test_compiled_layers_train_as_the_plain_model_on_one_process(tp1_results, family):
    reports, compiled, graphs, breaks, fused = tp1_results[family]
    assert_equal_training(reports, f"{family} tp1", tol=TOL)
    assert compiled == REGIONS[family], (family, compiled)
    assert graphs > 0, f"{family}: nothing was compiled"
    # kernels only: each region is whole, one graph, which Inductor fuses end to end (with
    # tensor parallelism Slapo's collectives split a layer on purpose)
    assert breaks == 0, f"{family}: {breaks} graph break(s) in its compiled regions"
    # compile(fuse_projections=True): each layer's projections that read one input are one
    # matmul (and the model still trains as the plain one, above)
    assert fused == FUSED[family], (family, fused)


def _graphs_for(layers: int) -> int:
    import torch._dynamo
    import torch._dynamo.utils

    import slapo
    from slapo.model_schedule import schedule_model
    from slapo_ae.zoo import build_model, synthetic_batch

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = build_model("llama-tiny", num_hidden_layers=layers)
    sch = slapo.create_schedule(model)
    schedule_model(sch, tensor_parallel=False, kernel_opt=True, compile_layers=True)
    batch = synthetic_batch(model.config, 2, 16, 0, seed=0)
    slapo.build_module(sch)(**batch).loss.backward()
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.slow
def test_identical_layers_share_their_compiled_code():
    """A layer compiles once for all layers of its kind: Dynamo guards on what flows through
    a region, not on which module it is (else 24 layers would exceed its recompile limit of 8
    and run eagerly)."""
    import torch._dynamo

    torch._dynamo.config.fail_on_recompile_limit_hit = True
    assert _graphs_for(12) == _graphs_for(2)
