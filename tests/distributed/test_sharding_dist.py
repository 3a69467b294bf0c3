"""Sharding and forward collectives on 2 gloo ranks: embedding sharded along the hidden axis
with an all-gather, a reduce-scatter, and the errors that depend on the world size."""

import copy

import torch
from distributed import run_ranks
from torch import nn

import slapo
from slapo.verify import train_side_by_side

TOL = 1e-5


class EmbedProject(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 16, padding_idx=3)
        self.proj = nn.Linear(16, 8)

    def forward(self, ids):
        return self.proj(self.embed(ids))


def _loss(model, batch):
    out = model(batch["ids"])
    return out.pow(2).mean(), out


def _batches():
    return [{"ids": torch.randint(0, 64, (4, 6), generator=torch.Generator().manual_seed(s))}
            for s in range(3)]


def _schedule_hidden_sharded(sch):
    sch["embed"].shard("weight", axis=1)               # hidden features split across ranks
    sch["embed"].sync("fwd_post", "all_gather", axis=-1,
                      tensor_parallel_output_grad=False)  # a replicated proj reads it


def _schedule_vocab_sharded_reduce_scatter(sch):
    sch["embed"].shard("weight", axis=0)               # vocabulary split across ranks
    sch["embed"].sync("fwd_post", "reduce_scatter", axis=-1)  # sum partials, keep my features
    sch["proj"].shard("weight", axis=1)                # row parallel on those features
    sch["proj"].sync("fwd_post", "all_reduce")


def _run_all():
    results = {}
    for name, schedule in [("all_gather", _schedule_hidden_sharded),
                           ("reduce_scatter", _schedule_vocab_sharded_reduce_scatter)]:
        torch.manual_seed(0)
        plain = EmbedProject()
        sch = slapo.create_schedule(copy.deepcopy(plain))
        schedule(sch)
        results[name] = train_side_by_side(plain, slapo.build_module(sch), _batches(), _loss)

    errors = {}
    sch = slapo.create_schedule(nn.Linear(5, 4))
    try:
        sch.shard("weight", axis=1)
    except ValueError as err:
        errors["indivisible"] = str(err)
    sch = slapo.create_schedule(EmbedProject())
    sch["proj"].annotate("weight", "tp", "row")
    sch["proj"].shard("weight", axis=1)
    errors["annotation"] = slapo.get_annotations(sch["proj"].mod.weight)
    errors["local_shape"] = tuple(sch["proj"].mod.weight.shape)
    errors["orig_shape"] = tuple(sch["proj"].mod.weight.orig_shape)  # upstream's attribute
    try:
        sch["proj"].shard("weight", axis=0)
    except ValueError as err:
        errors["reshard"] = str(err)
    return results, errors


def test_forward_collectives_and_world_size_errors():
    for results, errors in run_ranks(_run_all):
        for name, reports in results.items():
            for step, report in enumerate(reports):
                assert report.loss_error <= TOL, (name, step)
                assert report.output_error <= TOL, (name, step)
                assert report.max_grad_error[1] <= TOL, (name, step, report.max_grad_error)
        assert errors["indivisible"] == ("cannot shard '<root>.weight' of shape (4, 5) along axis "
                                         "1 over 2 ranks: 5 is not divisible by 2 (a vocabulary: "
                                         "shard it with pad=True)")
        assert errors["annotation"] == {"tp": "row"}
        assert errors["local_shape"] == (8, 8)
        assert errors["orig_shape"] == (8, 16)
        assert "already sharded along axis 1" in errors["reshard"]


def _all_to_all_with_and_without_gloo_support():
    """The same re-shard (and its backward) through gloo's all-to-all and through the
    all-gather that stands in where gloo has none (torch before 2.13 refuses the call)."""
    import torch.distributed as dist

    from slapo.sharding import all_to_all_forward

    rank = dist.get_rank()
    torch.manual_seed(rank)
    x = torch.randn(4, 6, 8)

    def reshard_and_grad():
        leaf = x.clone().requires_grad_()
        out = all_to_all_forward(leaf, split_axis=2, cat_axis=1)
        (out * torch.arange(out.numel()).view_as(out)).sum().backward()
        return out.detach(), leaf.grad

    native = reshard_and_grad()
    real_all_to_all = dist.all_to_all

    def refuse(*args, **kwargs):
        raise RuntimeError("Backend gloo does not support alltoall")

    dist.all_to_all = refuse
    try:
        stand_in = reshard_and_grad()
    finally:
        dist.all_to_all = real_all_to_all
    return native, stand_in


def test_all_to_all_without_gloo_support_gives_the_same_reshard_and_gradient():
    for (out, grad), (out_stand_in, grad_stand_in) in run_ranks(
            _all_to_all_with_and_without_gloo_support):
        assert out.shape == (4, 12, 4)
        torch.testing.assert_close(out_stand_in, out, rtol=0, atol=0)
        torch.testing.assert_close(grad_stand_in, grad, rtol=0, atol=0)


class _RowParallelCases(nn.Module):
    """One module of each kind a row-parallel shard adjusts, each given its input whole."""

    def __init__(self):
        super().__init__()
        from transformers.pytorch_utils import Conv1D

        self.linear = nn.Linear(16, 8)
        self.linear_no_bias = nn.Linear(16, 8, bias=False)
        self.conv = nn.Conv2d(4, 2, kernel_size=1)
        self.conv1d = Conv1D(8, 16)  # GPT-2's linear: weight (in, out)


def _row_parallel_without_split_input():
    sch = slapo.create_schedule(_RowParallelCases())
    for name, axis in [("linear", 1), ("linear_no_bias", 1), ("conv", 1), ("conv1d", 0)]:
        sch[name].shard("weight", axis=axis)  # (no sync: a partial sum is enough here)
    model = slapo.build_module(sch)
    whole = {"linear": torch.randn(3, 16), "linear_no_bias": torch.randn(3, 16),
             "conv": torch.randn(2, 4, 5, 5), "conv1d": torch.randn(3, 16)}
    errors, split_ok = {}, {}
    for name, x in whole.items():
        module = getattr(model, name)
        try:
            module(x)
        except ValueError as err:
            errors[name] = str(err)
        # given its part of the features, the module runs, also as one compiled graph
        axis = 1 if name == "conv" else -1
        part = x.chunk(2, dim=axis)[0]
        eager = module(part)
        compiled = torch.compile(module, fullgraph=True, backend="eager")(part)
        split_ok[name] = torch.equal(eager, compiled)
    try:  # inside a compiled region the same error comes out
        torch.compile(model.linear, backend="eager")(whole["linear"])
    except ValueError as err:
        errors["compiled linear"] = str(err)
    return errors, split_ok


def test_a_row_parallel_module_given_its_whole_input_names_its_weight():
    """A row-parallel shard without a column-parallel partner before it (or a split of its
    input) fails at the first forward; the error names the weight and says what to do, where
    torch's names two shapes. Given its part of the features, each runs, also compiled as
    one graph (the check costs no graph break)."""
    for errors, split_ok in run_ranks(_row_parallel_without_split_input):
        assert split_ok == dict.fromkeys(["linear", "linear_no_bias", "conv", "conv1d"], True)
        assert errors["linear"] == (
            "'linear.weight' is sharded along its input features (row parallel) over 2 ranks: "
            "each rank takes 8 of its 16 input features, but its input has 16. Its input must "
            "arrive split: shard the module that computes it along its output features (column "
            "parallel), or split it with a fwd_pre sync")
        assert errors["linear_no_bias"].startswith("'linear_no_bias.weight' is sharded along")
        assert "each rank takes 2 of its 4 input features, but its input has 4" in \
            errors["conv"]
        assert errors["conv1d"].startswith("'conv1d.weight' is sharded along its input")
        assert errors["compiled linear"] == errors["linear"]
