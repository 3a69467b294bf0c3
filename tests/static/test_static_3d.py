"""3D parallelism (``slapo.Topology`` and ``build(target="pipeline", topology=...)``) on 4 gloo
CPU ranks, one spawn for every check:

- pipeline 2 x tensor 2: a tiny LLaMA and a tiny GPT-Neo (dropout off),
  tensor-parallel by their family schedules over the topology's tensor groups (the LLaMA
  with the kernels and its first layer checkpointed, the GPT-Neo with transformers' own
  attention), then traced whole and cut after their first layer, train 2 SGD steps (GPipe,
  2 microbatches) with the plain model's loss and gradients (sharded gradients gathered over
  the tensor group, the two stages together). GPT-Neo's stages pass ints (its sequence
  length and hidden size), LLaMA's the tuple of rotary embeddings; the sequence (20) is
  longer than GPT-Neo's local window (16). GPT-Neo's LM head is tied to its word embedding:
  both stages hold the weight, and their gradients are summed.
- pipeline 2 x tensor 2 with the vocabulary sharded too (``shard_embedding``, as the
  harness's ``slapo-megatron`` runs it), kernels on: the family schedule makes the loss the
  vocabulary-parallel cross entropy (``vocab_parallel_loss``); tracing the root takes it out
  of the forward and the pipeline's last stage computes it (no ``loss_fn`` given), on the
  logits each tensor rank holds a vocabulary slice of. GPT-Neo's tied embedding is sharded
  in both stages that hold it.
- data 2 x pipeline 2: the GPT-Neo on two replicas, each on half of the batch, weights drawn
  by ``init_weights`` from a different seed on every rank: the replicas and the two copies
  of the tied weight start alike (build broadcasts over the stage's ranks, then from the
  first stage) and, with their gradients averaged over the data group, train like the plain
  model started from those weights.
- pipeline 4: the GPT-Neo in four stages, the tied weight in the first and the last (a
  group of those two ranks sums its gradients), the ints passing through the middle stages.
- the groups are the layout of ``slapo.topology.rank_lists``; misuse is a clear error.

- pipeline 2 x tensor 2 of the LLaMA with each layer one ``torch.compile`` region (as its
  schedule runs on a GPU; Inductor compiles for the CPU here): the trace keeps the regions
  whole, the stages run them, and the training is the plain model's.

Tolerance: relative error (``slapo.verify.relative_error``) at most 1e-5 for each step's loss
(the mean over microbatches and replicas against the full-batch loss) and each gradient, as
in the tensor-parallel tests; 1e-4 with compiled layers, as in the compile tests.
"""

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks
from static_models import Chain

import slapo
from slapo.model_schedule import schedule_model
from slapo.topology import rank_lists
from slapo.verify import full_tensor, relative_error
from slapo_ae.zoo import build_model, no_dropout, synthetic_batch

pytestmark = pytest.mark.slow

TOL = 1e-5
STEPS = 2
BATCH, SEQ = 4, 20
LR = 0.1
CUTS = {"llama-tiny": "model.layers.0", "gpt-neo-tiny": "transformer.h.0"}
FOUR_STAGES = ("transformer.h.0", "transformer.h.1", "transformer.ln_f")


def _model(name):
    return build_model(name, **no_dropout(name))  # GPT-Neo's LM head is its word embedding


def _batch(name, step, size=BATCH):
    """Input ids, a padding mask (the last sequence ends in 5 masked tokens) and labels;
    every label counts, so that the mean over equal microbatches is the batch's mean."""
    batch = synthetic_batch(name, size, SEQ, seed=10 + step)
    batch["attention_mask"][-1, -5:] = 0
    return batch["input_ids"], batch["attention_mask"], batch["labels"]


def causal_loss(output, labels):
    logits = output[0] if isinstance(output, (tuple, list)) else output
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                           labels[:, 1:].reshape(-1))


def _full(module, group, grads=True):
    return {name: full_tensor(p, p.grad if grads else p.data, group).clone()
            for name, p in module.named_parameters()}


def _train(name, dp, pp, tp, init_weights=False, cuts=None, shard_embedding=False, **options):
    from torch._dynamo.utils import counters

    graphs_before = counters["stats"]["unique_graphs"]
    topo = slapo.Topology(dp=dp, pp=pp, tp=tp)
    torch.manual_seed(100 + topo.rank)  # init_weights draws differently on every rank
    model = _model(name)
    sch = slapo.create_schedule(model, group=topo.tensor_group)
    schedule_model(sch, tensor_parallel=True, shard_embedding=shard_embedding, **options)
    ids, mask, _ = _batch(name, 99, size=2)
    sch.trace(example_inputs={"input_ids": ids, "attention_mask": mask},
              concrete_args={"use_cache": False, "return_dict": False})
    for cut in cuts or [CUTS[name]]:
        sch[cut].cut_pipeline_stage()
    # a vocabulary-sharded model's loss is the schedule's (vocab-parallel), taken by trace
    pipe, _ = slapo.build(sch, target="pipeline", topology=topo, n_microbatches=2,
                          loss_fn=None if shard_embedding else causal_loss,
                          init_weights=model._init_weights if init_weights else False)
    initial = _full(pipe.module, topo.tensor_group, grads=False)
    opt = torch.optim.SGD(pipe.module.parameters(), lr=LR)
    share = BATCH // dp
    rows = slice(topo.data_rank * share, (topo.data_rank + 1) * share)
    steps = []
    for step in range(STEPS):
        ids, mask, labels = _batch(name, step)
        losses = pipe.step(ids[rows], mask[rows], target=labels[rows])
        steps.append(([loss.item() for loss in losses], _full(pipe.module, topo.tensor_group)))
        opt.step()
        opt.zero_grad()
    groups = {axis: topo.ranks(axis) for axis in ("tensor", "pipe", "data", "stage")}
    return {"coords": (topo.data_rank, topo.stage_index, topo.tensor_rank),
            "is_last": pipe.is_last, "groups": groups, "initial": initial, "steps": steps,
            "compiled_graphs": counters["stats"]["unique_graphs"] - graphs_before}


def _chain(group, cuts=("a",)):
    sch = slapo.create_schedule(Chain(), group=group)
    sch.trace(example_inputs=(torch.randn(2, 4),))
    for cut in cuts:
        sch[cut].cut_pipeline_stage()
    return sch


def _errors():
    """The message of each misuse (every rank raises the same, before any collective)."""
    topo = slapo.Topology(pp=2, tp=2)

    def message(fn):
        try:
            fn()
        except Exception as err:  # noqa: BLE001 - the test reads the type and message
            return f"{type(err).__name__}: {err}"
        return None

    def build(sch, **kwargs):
        return slapo.build(sch, target="pipeline", init_weights=False, n_microbatches=2,
                           **kwargs)

    return {
        "world": message(lambda: slapo.Topology(dp=3, tp=2)),
        "group": message(lambda: build(_chain(None), topology=topo)),
        "stages": message(lambda: build(_chain(topo.tensor_group, ("a", "b")), topology=topo)),
        "both": message(lambda: build(_chain(topo.tensor_group), topology=topo,
                                      group=topo.pipeline_group)),
        "type": message(lambda: build(_chain(topo.tensor_group), topology="pp2 x tp2")),
        "axis": message(lambda: topo.ranks("model")),
        "ok": message(lambda: build(_chain(topo.tensor_group), topology=topo)),
    }


def _all():
    return {"llama": _train("llama-tiny", dp=1, pp=2, tp=2, kernel_opt=True, ckpt_ratio=0.5),
            "gpt_neo": _train("gpt-neo-tiny", dp=1, pp=2, tp=2, kernel_opt=False),
            "llama_vocab": _train("llama-tiny", dp=1, pp=2, tp=2, kernel_opt=True,
                                  shard_embedding=True),
            "gpt_neo_vocab": _train("gpt-neo-tiny", dp=1, pp=2, tp=2, kernel_opt=True,
                                    shard_embedding=True),
            # as on a GPU (Slapo-3D there): each layer one torch.compile region (Inductor,
            # here for the CPU), kept whole by the trace and the stage cuts
            "llama_compiled": _train("llama-tiny", dp=1, pp=2, tp=2, kernel_opt=True,
                                     shard_embedding=True, device="cpu", compile_layers=True),
            "data_parallel": _train("gpt-neo-tiny", dp=2, pp=2, tp=1, init_weights=True,
                                    kernel_opt=True),
            "four_stages": _train("gpt-neo-tiny", dp=1, pp=4, tp=1, kernel_opt=False,
                                  cuts=FOUR_STAGES),
            "errors": _errors()}


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_all, world_size=4)


def _merged(values, what):
    """One dict from the ranks' dicts; ranks holding the same name hold the same value."""
    merged = {}
    for value in values:
        for name, tensor in value.items():
            if name in merged:
                err = relative_error(tensor, merged[name])
                assert err <= TOL, f"{what}: '{name}' differs across ranks by {err:.1e}"
            merged[name] = tensor
    return merged


def _assert_trains_like_plain(runs, name, plain, tol=TOL):
    opt = torch.optim.SGD(plain.parameters(), lr=LR)
    for step in range(STEPS):
        ids, mask, labels = _batch(name, step)
        loss = causal_loss(plain(input_ids=ids, attention_mask=mask, return_dict=False), labels)
        loss.backward()
        # each replica's last stage reports its microbatches (the tensor ranks alike)
        micro = [x for r in runs if r["is_last"] and r["coords"][2] == 0
                 for x in r["steps"][step][0]]
        assert len(micro) == 2 * max(r["coords"][0] + 1 for r in runs)
        assert all(r["steps"][step][0] == [] for r in runs if not r["is_last"])
        err = abs(sum(micro) / len(micro) - loss.item()) / abs(loss.item())
        assert err <= tol, f"{name} step {step}: loss {sum(micro) / len(micro)} vs {loss.item()}"
        grads = _merged([r["steps"][step][1] for r in runs], f"{name} step {step}")
        expected = {n: p.grad for n, p in plain.named_parameters(remove_duplicate=False)}
        assert sorted(grads) == sorted(expected)  # each parameter, by each of its names
        for param, grad in grads.items():
            err = relative_error(grad, expected[param])
            assert err <= tol, f"{name} step {step}: gradient of '{param}' off by {err:.1e}"
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("run,name", [("llama", "llama-tiny"), ("gpt_neo", "gpt-neo-tiny"),
                                      ("llama_vocab", "llama-tiny"),
                                      ("gpt_neo_vocab", "gpt-neo-tiny")])
def test_pipeline_2_by_tensor_2_trains_like_the_plain_model(ranks, run, name):
    runs = [r[run] for r in ranks]
    assert [r["coords"] for r in runs] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    _assert_trains_like_plain(runs, name, _model(name))


def test_pipeline_stages_of_compiled_layers_train_like_the_plain_model(ranks):
    runs = [r["llama_compiled"] for r in ranks]
    assert all(r["compiled_graphs"] >= 1 for r in runs)  # the stages ran compiled regions
    _assert_trains_like_plain(runs, "llama-tiny", _model("llama-tiny"), tol=1e-4)


def test_data_2_by_pipeline_2_starts_alike_and_trains_like_the_plain_model(ranks):
    runs = [r["data_parallel"] for r in ranks]
    assert [r["coords"] for r in runs] == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)]
    initial = _merged([r["initial"] for r in runs], "initial weights")  # replicas alike
    assert torch.equal(initial["transformer.ln_f.weight"], torch.ones(128))  # _init_weights
    assert torch.equal(initial["lm_head.weight"], initial["transformer.wte.weight"])  # tied
    plain = _model("gpt-neo-tiny")
    fc = "transformer.h.0.mlp.c_fc.weight"
    assert relative_error(initial[fc], plain.get_parameter(fc)) > 0.5  # drawn anew
    assert sorted(initial) == sorted(n for n, _ in plain.named_parameters(remove_duplicate=False))
    plain.load_state_dict(initial)
    _assert_trains_like_plain(runs, "gpt-neo-tiny", plain)


def test_four_stages_with_the_tie_in_the_first_and_last(ranks):
    runs = [r["four_stages"] for r in ranks]
    assert [r["coords"] for r in runs] == [(0, k, 0) for k in range(4)]
    assert "transformer.wte.weight" in runs[0]["initial"]
    assert "lm_head.weight" in runs[3]["initial"]
    _assert_trains_like_plain(runs, "gpt-neo-tiny", _model("gpt-neo-tiny"))


def test_groups_follow_the_layout(ranks):
    for run, (dp, pp, tp) in (("llama", (1, 2, 2)), ("data_parallel", (2, 2, 1))):
        lists = rank_lists(dp=dp, pp=pp, tp=tp)
        for rank, result in enumerate(ranks):
            for axis, members in result[run]["groups"].items():
                assert members in lists[axis] and rank in members, (run, rank, axis)


def test_misuse_is_a_clear_error(ranks):
    for rank, result in enumerate(ranks):
        errors = result["errors"]
        assert errors["world"] == ("ValueError: topology dp 3 x pp 1 x tp 2 = 6 ranks, but the "
                                   "world has 4")
        tensor = "[0, 1]" if rank < 2 else "[2, 3]"
        assert errors["group"].startswith(f"ValueError: the schedule's group has ranks "
                                          f"[0, 1, 2, 3], but Topology(dp=1, pp=2, tp=2; rank "
                                          f"{rank}: ")
        assert f"has the tensor group {tensor}: create the schedule with create_schedule(" \
            "model, group=topology.tensor_group)" in errors["group"]
        assert errors["stages"] == ("ValueError: 3 pipeline stages (2 cuts) for a topology "
                                    "with pp=2")
        assert errors["both"].startswith("ValueError: build(target='pipeline'): pass topology= "
                                         "or group=/stage_index=, not both")
        assert errors["type"].startswith("TypeError: topology= takes a slapo.Topology, got str")
        assert errors["axis"].startswith("ValueError: unknown topology axis 'model'")
        assert errors["ok"] is None
