"""slapo.Verify around a block that cuts pipeline stages (``topology=``, ``config=``): the
plain model against the pipeline ``build(target="pipeline")`` makes, on gloo CPU ranks.

- 2 ranks, pipeline 2: a chain of linears made under ``init_empty_weights`` (its input
  given by position or by name, checked in eval or train mode, built again after) and a tiny BERT
  LM head model traced with transformers' tracer (its decoder tied to the word embedding,
  which both stages then hold; a ModelOutput from the last stage), 2 micro-batches each from
  the config's micro-batch size, pass, also with attention dropout, traced in train mode and
  checked in eval mode (the traced dropout follows the mode); traced in eval mode and checked
  in train mode it fails, saying why; a stage that doubles its output fails on the loss,
  one that doubles a gradient on that gradient (the loss agrees); the arguments a pipeline
  check needs are asked for by name.
- 4 ranks: data 2 x pipeline 2 (each replica its own batch) and pipeline 2 x tensor 2 (a
  column- then a row-parallel linear, upstream's schedule) pass; the same tensor-parallel
  schedule without the row-parallel output's all-reduce fails.

Tolerance: Verify's default, relative error 1e-5 of the loss and of each gradient.
"""

import re

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks
from torch import nn

import slapo
from slapo.framework_dialect.deepspeed.pipeline import create_dist_group_for_pipeline, get_ds_config


class Chain(nn.Module):
    def __init__(self, layers=4, relu=False):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(layers))
        self.relu = relu

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
            x = torch.relu(x) if self.relu else x
        return x


def _batch(rows=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 8, generator=gen), torch.randint(0, 8, (rows,), generator=gen)


def _verify_chain(num_pp, num_mp, schedule, rows=8, micro=4, seed=0, layers=4, relu=False,
                  by_name=False, eval_mode=True, rebuild=False):
    """Verify ``schedule(sch)`` on a meta Chain (its input by name: ``by_name``); the error
    message, or "passed" (with ``rebuild``, and the losses of the pipeline built after)."""
    topology, group = create_dist_group_for_pipeline(num_pp=num_pp, num_mp=num_mp)
    with slapo.init_empty_weights():
        model = Chain(layers, relu)
    sch = slapo.create_schedule(model, group=group)
    x, y = _batch(rows, seed)
    try:
        with slapo.Verify(sch, {"x": x} if by_name else [x], example_outputs=y,
                          loss_fn=F.cross_entropy, topology=topology, eval_mode=eval_mode,
                          config=get_ds_config(rows, micro_batch_size_per_gpu=micro, fp16=False)):
            schedule(sch)
    except (AssertionError, ValueError) as err:
        return str(err)
    if not rebuild:
        return "passed"
    pipe, _ = slapo.build(sch, target="pipeline", topology=topology, n_microbatches=2,
                          loss_fn=F.cross_entropy, init_weights=False)
    return "passed", [loss.item() for loss in pipe.step(x, target=y)]


def _cut(sch, after="layers.1"):
    sch.trace()
    sch[after].cut_pipeline_stage()


def _doubles(where):
    def schedule(sch):
        sch["layers.3"].sync(where, lambda t: t * 2)
        _cut(sch)
    return schedule


def _tiny_bert(attention_dropout):
    from transformers import BertConfig, BertLMHeadModel
    config = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, vocab_size=128, attn_implementation="eager",
                        attention_probs_dropout_prob=attention_dropout)
    with slapo.init_empty_weights():
        return BertLMHeadModel(config), config


def _verify_bert(attention_dropout=0.0, traced_in_eval=False):
    """transformers' attention passes its dropout rate on as a value: a trace in train mode
    makes it follow the mode, one in eval mode keeps eval's rate, 0, in train mode too."""
    import inspect
    topology, group = create_dist_group_for_pipeline(num_pp=2, num_mp=1)
    model, config = _tiny_bert(attention_dropout)
    sch = slapo.create_schedule(model, group=group)
    names = ["input_ids", "attention_mask", "token_type_ids"]
    concrete = {p.name: p.default for p in inspect.signature(model.forward).parameters.values()
                if p.name not in names}
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (4, 16), generator=gen)
    inputs = [ids, torch.ones(4, 16), torch.zeros(4, 16, dtype=torch.long)]
    labels = torch.randint(0, 128, (4, 16), generator=gen)

    def loss_fn(output, labels):
        logits = output if isinstance(output, torch.Tensor) else output["logits"]
        return F.cross_entropy(logits[:, :-1].reshape(-1, config.vocab_size),
                               labels[:, 1:].reshape(-1))

    try:
        with slapo.Verify(sch, inputs, example_outputs=labels, loss_fn=loss_fn,
                          topology=topology, eval_mode=not traced_in_eval,
                          config=get_ds_config(4, micro_batch_size_per_gpu=2, fp16=False)):
            sch.mod.train(not traced_in_eval)
            sch.trace_until("bert.encoder", tracer="huggingface", concrete_args=concrete)
            sch["bert.encoder.layer.0"].cut_pipeline_stage()
    except AssertionError as err:
        return str(err)
    tied = sch.mod.get_parameter("cls.predictions.decoder.weight") is \
        sch.mod.get_parameter("bert.embeddings.word_embeddings.weight")
    return "passed", tied, all(p.grad is None for p in sch.mod.parameters())


def _errors():
    topology, group = create_dist_group_for_pipeline(num_pp=2, num_mp=1)
    x, y = _batch()
    found = {}

    def attempt(key, schedule, **kwargs):
        sch = slapo.create_schedule(Chain(), group=group)
        try:
            with slapo.Verify(sch, [x], **kwargs):
                schedule(sch)
            found[key] = "passed"
        except (ValueError, TypeError) as err:
            found[key] = str(err)

    attempt("no topology", _cut, example_outputs=y, loss_fn=F.cross_entropy)
    attempt("no cuts", lambda sch: sch.trace(), example_outputs=y, loss_fn=F.cross_entropy,
            topology=topology, config={"train_micro_batch_size_per_gpu": 4})
    attempt("no loss", _cut, topology=topology)
    attempt("uneven", _cut, example_outputs=y, loss_fn=F.cross_entropy, topology=topology,
            config={"train_micro_batch_size_per_gpu": 3})
    return found


def _two_ranks():
    return {"pp": _verify_chain(2, 1, _cut, rebuild=True),
            "pp by name, training": _verify_chain(2, 1, _cut, by_name=True, eval_mode=False),
            "bert": _verify_bert(),
            "bert traced with dropout": _verify_bert(attention_dropout=0.1),
            "bert traced in eval mode": _verify_bert(attention_dropout=0.1, traced_in_eval=True),
            "wrong forward": _verify_chain(2, 1, _doubles("fwd_post")),
            "wrong backward": _verify_chain(2, 1, _doubles("bwd_post")),
            "errors": _errors(),
            "last": torch.distributed.get_rank() == 1}


def _tensor_parallel(sync_output):
    def schedule(sch):  # upstream's pp + tp schedule: column-, then row-parallel
        sch["layers.0"].shard("weight", axis=0)
        sch["layers.0"].shard("bias", axis=0)
        sch["layers.1"].shard("weight", axis=1)
        if sync_output:
            sch["layers.1"].sync("fwd_post", "all_reduce")
        sch.trace()
        sch["layers.0"].cut_pipeline_stage()
    return schedule


def _four_ranks():
    import torch.distributed as dist
    rank = dist.get_rank()
    return {"pp dp": _verify_chain(2, 1, _cut, seed=rank),  # each replica its own batch
            "pp tp": _verify_chain(2, 2, _tensor_parallel(True), layers=2, relu=True),
            "pp tp unsynced": _verify_chain(2, 2, _tensor_parallel(False), layers=2,
                                            relu=True)}


def test_two_stage_pipeline_verified_and_wrong_stages_caught():
    for found in run_ranks(_two_ranks):
        outcome, losses = found["pp"]
        assert outcome == "passed"
        assert len(losses) == (2 if found["last"] else 0)  # built again after the check
        assert found["pp by name, training"] == "passed"
        assert found["bert"] == ("passed", True, True)  # tie kept, gradients left as they were
        assert found["bert traced with dropout"] == ("passed", True, True)
        assert "'<root>' was traced in eval mode and is checked in train mode" in \
            found["bert traced in eval mode"]
        assert "the pipeline's loss" in found["wrong forward"]
        assert "traced in" not in found["wrong forward"]  # no dropout: no hint about modes
        assert re.search(r"the gradient of 'layers\.[012]\.", found["wrong backward"])
        errors = found["errors"]
        assert "pass topology=slapo.Topology(dp=, pp=, tp=)" in errors["no topology"]
        assert "topology= and config= are for a schedule that cuts" in errors["no cuts"]
        assert "pass loss_fn= and example_outputs=" in errors["no loss"]
        assert "8 rows, not a multiple of the micro-batch size 3" in errors["uneven"]


@pytest.mark.slow
def test_data_and_tensor_parallel_pipelines_verified_on_four_ranks():
    for found in run_ranks(_four_ranks, world_size=4):
        assert found["pp dp"] == "passed"
        assert found["pp tp"] == "passed"
        assert "differs from the plain model's" in found["pp tp unsynced"]
