"""Static-graph schedules on 2 gloo CPU ranks (one spawn for both checks):

- pipeline: a BERT MLM traced whole and cut after layer 1 trains in two stages with
  ``torch.distributed.pipelining`` (``ScheduleGPipe``, 2 microbatches) with the same losses and
  gradients as one process over 3 SGD steps, and so does the same model partitioned first
  with upstream's ``generate_pipeline_partition``;
- tensor parallelism after ``decompose``: a BERT FFN with decomposed Linears (column-parallel
  first, row-parallel second) and a fused bias+GeLU trains like the plain FFN;
- tracing after tensor parallelism: a sharded BERT layer, traced, trains like the plain one;
- upstream Slapo's order: a BERT layer sharded first (attention and MLP), then its bias+GeLU
  fused as upstream's BERT schedule fuses it (``decompose``, ``trace(flatten=True)``, ``find``,
  ``fuse(compiler="TorchScript")``), trains like the plain one (the column-parallel Linear's
  ``sync`` stays on its matmul: without it the attention's gradients would be wrong).

Tolerance: relative error (``slapo.verify.relative_error``) at most 1e-5 for each step's loss
(the mean of the microbatch losses against the full-batch loss) and each parameter's gradient.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks
from static_models import (
    EXAMPLE,
    FFN,
    RUN,
    STEPS,
    TOL,
    assert_trains_alike,
    bert_config,
    hidden,
    pipeline_batch,
    pipeline_loss,
    pipeline_model,
    pipeline_schedule,
    square_loss,
)
from torch import nn

import slapo
from slapo.pipeline import generate_pipeline_partition
from slapo.verify import relative_error, train_side_by_side


def _pipeline(partition_first=False):
    sch = pipeline_schedule(pipeline_model())
    if partition_first:  # upstream's spelling: the root made of its stages, then built
        generate_pipeline_partition(sch)
    pipe, _ = slapo.build(sch, target="pipeline", init_weights=False, n_microbatches=2,
                          loss_fn=pipeline_loss)
    opt = torch.optim.SGD(pipe.module.parameters(), lr=0.1)
    steps = []
    for step in range(STEPS):
        ids, mask, labels = pipeline_batch(step)
        losses = pipe.step(ids, mask, target=labels)
        grads = {n: p.grad.clone() for n, p in pipe.module.named_parameters()}
        steps.append(([loss.item() for loss in losses], grads))
        opt.step()
        opt.zero_grad()
    return {"stage": pipe.stage_index, "schedule": type(pipe.schedule).__name__,
            "steps": steps}


class BertFFN(nn.Module):
    def __init__(self):
        super().__init__()
        from transformers.models.bert.modeling_bert import BertIntermediate, BertOutput
        self.intermediate = BertIntermediate(bert_config())
        self.output = BertOutput(bert_config())

    def forward(self, x):
        return self.output(self.intermediate(x), x)


def _tensor_parallel_ffn():
    torch.manual_seed(0)
    plain = BertFFN()
    sch = slapo.create_schedule(copy.deepcopy(plain))
    sch.trace(example_inputs={"x": hidden(*EXAMPLE, 0)})
    ffn = sch["intermediate"]
    ffn["dense"].decompose()
    sch["output.dense"].decompose()
    ffn.fuse(ffn.find(lambda x, bias: F.gelu(x + bias))[0], compiler=None, name="bias_gelu")
    ffn["dense"].shard("weight", axis=0)          # column parallel: the bias follows
    ffn["dense"].sync("bwd_post", "all_reduce")
    sch["output.dense"].shard("weight", axis=1)   # row parallel: the graph adds the bias
    sch["output.dense"].sync("fwd_post", "all_reduce")
    model = slapo.build_module(sch)
    facts = {"local_bias": tuple(model.intermediate.dense.decomposed_bias.shape),
             "local_in": model.output.dense.in_features}
    batches = [{"x": hidden(*RUN, s)} for s in range(STEPS)]
    return facts, train_side_by_side(plain, model, batches, square_loss)


def _sharded_then_traced_layer():
    """Megatron-style TP of a BERT layer first, then trace: sharded Linears are leaves, the
    modules with sync hooks too, and the head count follows the sharded width (``view(...,
    -1, head_dim)``)."""
    from static_models import additive_mask
    from transformers.models.bert.modeling_bert import BertLayer
    torch.manual_seed(0)
    plain = BertLayer(bert_config())
    sch = slapo.create_schedule(copy.deepcopy(plain))
    for name in ("query", "key", "value"):
        sch[f"attention.self.{name}"].shard("weight", axis=0)
    sch["attention.self"].sync("bwd_post", "all_reduce")
    sch["intermediate.dense"].shard("weight", axis=0)
    sch["intermediate.dense"].sync("bwd_post", "all_reduce")
    for name in ("attention.output.dense", "output.dense"):
        sch[name].shard("weight", axis=1)
        sch[name].sync("fwd_post", "all_reduce")
    sch.trace(example_inputs={"hidden_states": hidden(*EXAMPLE, 0),
                              "attention_mask": additive_mask(*EXAMPLE, 0)})
    batches = [{"hidden_states": hidden(*RUN, s), "attention_mask": additive_mask(*RUN, s)}
               for s in range(STEPS)]
    return train_side_by_side(plain, slapo.build_module(sch), batches, square_loss)


def _upstream_order_layer():
    """Upstream's BERT schedule in its order: shard_attention, shard_mlp, fuse_bias_gelu."""
    from static_models import additive_mask
    from transformers.models.bert.modeling_bert import BertLayer
    torch.manual_seed(0)
    plain = BertLayer(bert_config())
    sch = slapo.create_schedule(copy.deepcopy(plain))
    for name in ("query", "key", "value"):
        sch[f"attention.self.{name}"].shard("weight", axis=0)
        sch[f"attention.self.{name}"].shard("bias", axis=0)
    sch["attention.self"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
    sch["attention.output.dense"].shard("weight", axis=1)
    sch["attention.output.dense"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    sch["intermediate.dense"].shard("weight", axis=0)
    sch["intermediate.dense"].shard("bias", axis=0)
    sch["intermediate.dense"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
    sch["output.dense"].shard("weight", axis=1)
    sch["output.dense"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    subsch = sch["intermediate"]
    subsch["dense"].decompose()
    subsch.trace(flatten=True)
    subgraph = subsch.find(lambda x, bias: F.gelu(x + bias))
    subsch.fuse(subgraph, compiler="TorchScript", name="FusedBiasGeLU")
    fused = type(sch["intermediate"].mod.FusedBiasGeLU_0).__name__
    batches = [{"hidden_states": hidden(*RUN, s), "attention_mask": additive_mask(*RUN, s)}
               for s in range(STEPS)]
    return fused, train_side_by_side(plain, slapo.build_module(sch), batches, square_loss)


def _both():
    return {"pipeline": _pipeline(), "partitioned": _pipeline(partition_first=True),
            "tp": _tensor_parallel_ffn(),
            "tp_then_trace": _sharded_then_traced_layer(),
            "upstream_order": _upstream_order_layer()}


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_both)


@pytest.mark.parametrize("run", ["pipeline", "partitioned"])
def test_two_stage_pipeline_trains_like_one_process(ranks, run):
    model = pipeline_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ranks = [r[run] for r in ranks]
    assert [r["stage"] for r in ranks] == [0, 1]
    assert ranks[0]["schedule"] == "ScheduleGPipe"
    for step in range(STEPS):
        ids, mask, labels = pipeline_batch(step)
        loss = pipeline_loss(model(input_ids=ids, attention_mask=mask, return_dict=False), labels)
        loss.backward()
        micro = ranks[1]["steps"][step][0]
        assert len(micro) == 2 and ranks[0]["steps"][step][0] == []
        assert abs(sum(micro) / len(micro) - loss.item()) <= TOL * abs(loss.item())
        expected = {n: p for n, p in model.named_parameters() if p.grad is not None}
        grads = {**ranks[0]["steps"][step][1], **ranks[1]["steps"][step][1]}
        assert sorted(grads) == sorted(expected)  # all parameters the model uses
        for name, grad in grads.items():
            err = relative_error(grad, expected[name].grad)
            assert err <= TOL, f"step {step}: gradient of '{name}' off by {err:.1e}"
        opt.step()
        opt.zero_grad()


def test_decomposed_linears_stay_shardable(ranks):
    for rank in ranks:
        facts, reports = rank["tp"]
        assert facts == {"local_bias": (FFN // 2,), "local_in": FFN // 2}
        assert_trains_alike(reports, "TP=2 FFN")


def test_sharded_layer_traces(ranks):
    for rank in ranks:
        assert_trains_alike(rank["tp_then_trace"], "TP=2 then trace")


def test_upstreams_order_shard_then_fuse_trains_like_the_plain_layer(ranks):
    for rank in ranks:
        fused, reports = rank["upstream_order"]
        assert fused == "RecursiveScriptModule"
        assert_trains_alike(reports, "upstream's order: TP=2, then bias+GeLU fused")
