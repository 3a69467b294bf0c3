"""Upstream Slapo's sync ops on 2 gloo ranks: each resharding scheme and the scatter give
the expected layout and, in the backward, the gradient of the plain computation; a
sequence-parallel MLP with ``tensor_parallel_output_grad`` trains like the plain one (and
with the flag off its input gradient is wrong); MLPs resharded through ``sync`` (upstream's
schemes) and one synced by hooks in upstream's form train like the plain one."""

import copy

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from torch import nn

import slapo
from slapo.sharding import all_reduce_forward, apply_forward_op, shard_slice
from slapo.verify import full_tensor, gradient_errors, relative_error

TOL = 1e-6
CASES = [  # (op, axis, input layout, output layout): layouts of the last two axes
    ("RR->RS", 0, "RR", "RS"), ("RR->SR", 0, "RR", "SR"),
    ("RS->RR", 0, "RS", "RR"), ("SR->RR", 0, "SR", "RR"),
    ("RS->SR", 0, "RS", "SR"), ("SR->RS", 0, "SR", "RS"),
    ("SR->SR", 0, "SR", "SR"),
    ("scatter", 1, "RR", "SR"), ("scatter", 2, "RR", "RS"), ("scatter", 0, "RR", "S.."),
]


def _local(x: torch.Tensor, layout: str) -> torch.Tensor:
    """This rank's part of the full ``x`` in ``layout`` ("S..": sharded along axis 0)."""
    axis = {"RR": None, "SR": -2, "RS": -1, "S..": 0}[layout]
    return x if axis is None else shard_slice(x, axis, None)


def _run_op_cases():
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(4, 6, 8, generator=gen)
    weight = torch.randn(4, 6, 8, generator=gen)
    plain = full.clone().requires_grad_()
    (weight * plain.pow(2)).sum().backward()  # the plain computation, on whole tensors
    results = {}
    for op, axis, src, dst in CASES:
        mine = _local(full, src).clone().requires_grad_()
        out = apply_forward_op(op, mine, None, axis)
        # the loss of the sharded program: each rank's part; a replicated output counts once
        part = (_local(weight, dst) * out.pow(2)).sum()
        part.backward()
        results[(op, axis)] = (relative_error(out, _local(full, dst)),
                               relative_error(mine.grad, _local(plain.grad, src)))
    return results


def test_reshard_and_scatter_layouts_and_gradients():
    for results in run_ranks(_run_op_cases):
        for (op, axis), (out_err, grad_err) in results.items():
            assert out_err <= TOL, f"{op} (axis {axis}): output off by {out_err:.1e}"
            assert grad_err <= TOL, f"{op} (axis {axis}): input gradient off by {grad_err:.1e}"


class MLP(nn.Module):
    def __init__(self, out_bias=True):
        super().__init__()
        self.act = nn.Tanh()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8, bias=out_bias)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(self.act(x))))


def _sequence_parallel(sch, tensor_parallel_output_grad=True):
    """Megatron-LM's sequence parallelism: the sequence split outside the tensor-parallel
    pair, gathered before the column-parallel fc1, reduce-scattered after the row-parallel
    fc2; the whole output gathered for a loss on every rank. (A parameter in the sequence-
    split part, such as fc2's bias, would get a partial gradient on each rank: the model
    has none.)"""
    sch.sync("fwd_pre", "scatter", axis=1)                  # x: my rows of the sequence
    sch["fc1"].sync("fwd_pre", "all_gather", axis=1,
                    tensor_parallel_output_grad=tensor_parallel_output_grad)
    sch["fc1"].shard(["weight", "bias"], axis=0)
    sch["fc2"].shard("weight", axis=1)
    sch["fc2"].sync("fwd_post", "reduce_scatter", axis=1)
    sch.sync("fwd_post", "all_gather", axis=1, tensor_parallel_output_grad=False)


def _through_sequence_layout(sch):
    """Upstream's MLP schemes: fc1's hidden-sharded output (RS) to the sequence layout and
    back, the second change before fc2 (fwd_pre); fc2 row parallel."""
    sch["fc1"].shard(["weight", "bias"], axis=0)
    sch["fc1"].sync("bwd_post", "all_reduce")
    sch["fc1"].sync("fwd_post", "RS->SR")
    sch["fc2"].sync("fwd_pre", "SR->RS")
    sch["fc2"].shard("weight", axis=1)
    sch["fc2"].sync("fwd_post", "all_reduce")


def _gathered_after_each(sch):
    """Both linears column parallel, each output gathered (RS->RR); fc2 reads a replicated
    input, so its input gradient is all-reduced before the gather's backward slices it."""
    for name in ("fc1", "fc2"):
        sch[name].shard(["weight", "bias"], axis=0)
        sch[name].sync("bwd_post", "all_reduce")
        sch[name].sync("fwd_post", "RS->RR")


def _scattered_into_row_parallel(sch):
    """fc1 replicated, its output scattered (RR->RS) into the row-parallel fc2."""
    sch["fc1"].sync("fwd_post", "RR->RS")
    sch["fc2"].shard("weight", axis=1)
    sch["fc2"].sync("fwd_post", "all_reduce")


def _upstream_hooks(sch):
    """Megatron's MLP with upstream-form hooks instead of named ops."""
    def allreduce_input_grad(module, grad_input, grad_output):
        grad = grad_input[0].clone()
        dist.all_reduce(grad)
        return (grad,)

    def allreduce_output(module, inputs, output):
        return all_reduce_forward(output)

    def double_input(module, inputs):  # a pre hook that changes the input, undone below
        return (inputs[0] * 2,)

    sch["fc1"].shard(["weight", "bias"], axis=0)
    sch["fc1"].sync("fwd_pre", double_input)
    sch["fc1"].sync("fwd_pre", lambda x: x / 2)                 # a tensor function
    sch["fc1"].sync("bwd_post", allreduce_input_grad)
    sch["fc2"].shard("weight", axis=1)
    sch["fc2"].sync("fwd_post", allreduce_output)               # before the deferred bias


def _train(schedule, out_bias=True, steps=2):
    """Plain and scheduled MLP side by side: per step the output, the input gradient and
    every parameter gradient's relative error."""
    torch.manual_seed(0)
    plain = MLP(out_bias)
    sch = slapo.create_schedule(copy.deepcopy(plain))
    schedule(sch)
    model = slapo.build_module(sch)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, model)]
    reports = []
    for step in range(steps):
        x = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(step))
        inputs = [x.clone().requires_grad_() for _ in range(2)]
        outs = [m(i) for m, i in zip((plain, model), inputs)]
        for out in outs:
            out.pow(2).mean().backward()
        grads = gradient_errors(plain, model)
        reports.append({"output": relative_error(outs[1], outs[0]),
                        "input grad": relative_error(inputs[1].grad, inputs[0].grad),
                        "param grad": max(grads.values())})
        for opt in opts:
            opt.step()
            opt.zero_grad()
    fc1 = full_tensor(model.fc1.weight, model.fc1.weight)
    reports.append({"fc1 after training": relative_error(fc1, plain.fc1.weight)})
    return reports


def _run_models():
    return {"sequence parallel": _train(_sequence_parallel, out_bias=False),
            "flag off": _train(lambda sch: _sequence_parallel(sch, False), out_bias=False),
            "RS->SR->RS": _train(_through_sequence_layout),
            "RS->RR": _train(_gathered_after_each),
            "RR->RS": _train(_scattered_into_row_parallel),
            "upstream hooks": _train(_upstream_hooks)}


@pytest.fixture(scope="module")
def model_results():
    return run_ranks(_run_models)


@pytest.mark.parametrize("name", ["sequence parallel", "RS->SR->RS", "RS->RR", "RR->RS",
                                  "upstream hooks"])
def test_scheduled_mlp_trains_like_the_plain_one(model_results, name):
    for results in model_results:
        for step, report in enumerate(results[name]):
            for what, err in report.items():
                assert err <= 1e-5, f"{name}, step {step}: {what} off by {err:.1e}"


def test_gather_without_tensor_parallel_output_grad_misses_the_other_ranks_part(model_results):
    for results in model_results:
        first = results["flag off"][0]
        assert first["output"] <= 1e-5 and first["param grad"] <= 1e-5
        assert first["input grad"] > 0.1  # the slice of a partial gradient, not the sum


def _upstream_named_collectives():
    """Upstream's ``slapo.sharding.sync_ops`` functions against the plain computation."""
    from slapo.sharding import sync_ops

    world, rank = dist.get_world_size(), dist.get_rank()
    full = torch.randn(3, 4, 6, generator=torch.Generator().manual_seed(1))
    weight = torch.randn(3, 4, 6, generator=torch.Generator().manual_seed(2))
    errors = {}
    # scatter then gather (replicated backward) is the identity, gradient included
    x = full.clone().requires_grad_()
    mine = sync_ops.scatter_forward_output(x, dim=1, group=None)
    out = sync_ops.all_gather_forward_output(mine, dim=1, group=None,
                                             tensor_parallel_output_grad=False)
    (weight * out).sum().backward()
    errors["scatter+gather"] = max(relative_error(out, full), relative_error(x.grad, weight))
    # reduce-scatter of the same x on every rank: world * my slice
    x = full.clone().requires_grad_()
    out = sync_ops.reduce_scatter_forward_output(x, dim=2, group=None)
    (shard_slice(weight, 2, None) * out).sum().backward()
    errors["reduce_scatter"] = max(relative_error(out, world * shard_slice(full, 2, None)),
                                   relative_error(x.grad, weight))
    # reduce in the forward (identity backward), reduce in the backward (identity forward)
    x = (full * (rank + 1)).requires_grad_()
    out = sync_ops.reduce_forward_output(x, None)
    (weight * out).sum().backward()
    total = sum(range(1, world + 1))
    errors["reduce_forward"] = max(relative_error(out, total * full),
                                   relative_error(x.grad, weight))
    x = full.clone().requires_grad_()
    out = sync_ops.reduce_backward_grad(x, None)
    (weight * (rank + 1) * out).sum().backward()
    errors["reduce_backward"] = max(relative_error(out, full),
                                    relative_error(x.grad, total * weight))
    return errors


def test_upstreams_named_collectives():
    for errors in run_ranks(_upstream_named_collectives):
        assert max(errors.values()) <= TOL, errors


class Embedded(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(16, 8)
        self.proj = nn.Linear(8, 4)

    def forward(self, ids):
        return self.proj(self.wte(ids))


def _upstream_embedding_hooks():
    """A vocabulary-parallel embedding with the hooks of upstream's GPT-2 schedule: the
    fwd_pre hook makes the ids local, the fwd_post hook zeroes the rows of other ranks' ids
    and sums over the ranks. Our shard masks global ids by itself; given such a hook it must
    take the ids as local (it looked up zeros: the output was off by 2.6, 2026-12-05)."""
    torch.manual_seed(0)
    plain = Embedded()
    sch = slapo.create_schedule(copy.deepcopy(plain))
    sch["wte"].shard("weight", axis=0)
    start = sch.rank * 16 // sch.world_size
    end = (sch.rank + 1) * 16 // sch.world_size

    seen = {}

    def fwd_pre_hook(_module, _input):
        seen["outside"] = outside = (_input[0] < start) | (_input[0] >= end)
        local = _input[0].clone() - start
        local[outside] = 0
        return local

    def fwd_post_hook(_module, _input, output):  # _input: the local ids the pre-hook gave
        output = output.masked_fill(seen["outside"].unsqueeze(-1), 0.0)
        return all_reduce_forward(output, sch.group)

    sch["wte"].sync(mode="fwd_pre", sync_op_or_fn=fwd_pre_hook)
    sch["wte"].sync(mode="fwd_post", sync_op_or_fn=fwd_post_hook)
    model = slapo.build_module(sch)
    ids = torch.arange(16).view(2, 8)
    out, expected = model(ids), plain(ids)
    out.sum().backward()
    expected.sum().backward()
    return relative_error(out, expected), gradient_errors(plain, model)


def test_an_upstream_id_hook_on_a_vocabulary_parallel_embedding_gives_local_ids():
    for out_err, grad_errs in run_ranks(_upstream_embedding_hooks):
        assert out_err <= TOL, f"output off by {out_err:.1e}"
        worst = max(grad_errs, key=grad_errs.get)
        assert grad_errs[worst] <= TOL, f"gradient of {worst} off by {grad_errs[worst]:.1e}"


def _batchnorm_buffers():
    """Upstream's WideResNet schedule shards a BatchNorm's running statistics with its
    weight and bias (channels split over the ranks); it was an error ('no parameter')."""
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(4)
    bn.running_mean += torch.arange(4.0)
    sch = slapo.create_schedule(copy.deepcopy(bn))
    sch.shard(["weight", "bias", "running_mean", "running_var"], axis=0)
    rank = dist.get_rank()
    x = torch.randn(2, 4, 3, 3)
    mine = x[:, 2 * rank:2 * rank + 2]
    model = slapo.build_module(sch).eval()
    return (tuple(model.running_mean.shape),
            relative_error(model(mine), bn.eval()(x)[:, 2 * rank:2 * rank + 2]))


def test_a_batchnorms_running_statistics_shard_with_its_channels():
    for shape, err in run_ranks(_batchnorm_buffers):
        assert shape == (2,) and err <= TOL


def _sync_without_shard():
    model = MLP()
    sch = slapo.create_schedule(model)
    sch["fc2"].sync("fwd_post", "all_reduce")
    try:
        slapo.build_module(sch)
    except ValueError as err:
        return str(err)
    return None


def test_an_all_reduce_where_nothing_is_sharded_is_refused_at_build():
    """Every rank holds the whole model: the all-reduce would sum two copies of the output,
    silently (a probe of bad input, 2026-12-05)."""
    for message in run_ranks(_sync_without_shard):
        assert message == ("sync at 'fc2' (fwd_post all_reduce) on 2 ranks, but nothing in the "
                           "model is sharded: every rank holds the whole module, so the "
                           "all_reduce would sum 2 copies of its result; shard the parameters "
                           "it reduces for (shard) or drop the sync")


def _tied_head_without_its_sync():
    import warnings

    from slapo_ae.zoo import build_model

    sch = slapo.create_schedule(build_model("bert-tiny"))
    sch["bert.embeddings.word_embeddings"].shard("weight", axis=0)  # the head is tied to it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        slapo.build_module(sch)
    return [str(w.message) for w in caught if "shares its weight" in str(w.message)]


def test_a_head_made_column_parallel_through_a_tie_without_its_sync_is_warned_of():
    """Sharding BERT's word embedding shards its tied decoder too: without a bwd_post
    all-reduce there, the loss is right and every gradient below the head about 70% off (a
    probe of upstream's BERT schedule, 2026-12-05). The build warns, naming the sync."""
    for messages in run_ranks(_tied_head_without_its_sync):
        assert messages == [
            "'cls.predictions.decoder' shares its weight with "
            "'bert.embeddings.word_embeddings.weight', sharded along axis 0: it is column "
            "parallel now, and the gradient of its input is this rank's partial sum; unless "
            "its input arrives sharded, add sch['cls.predictions.decoder'].sync('bwd_post', "
            "'all_reduce')"]
