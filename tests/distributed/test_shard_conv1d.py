"""transformers' ``Conv1D`` (weight ``(in, out)``) sharded on 2 gloo ranks equals the plain
module: column parallel (weight axis 1, bias with it), row parallel (weight axis 0, the bias
added once after the all-reduce), both in 3 parts (each rank keeps its slice of every third,
the layout of GPT-2's fused q/k/v), and
``slapo.op.Conv1DGeLU`` by columns; an nn.Linear pair in 3 parts too (its bias follows the
parts). Outputs, loss and every gradient (sharded ones gathered to full shape) over 3 SGD
steps, fp32. Also: build initialises the shards at full shape; the refusals.

Tolerance: relative error (slapo.verify) at most 1e-5.
"""

import copy

import pytest
import torch
from distributed import run_ranks
from torch import nn

import slapo
from slapo.op import Conv1DGeLU
from slapo.primitives.shard import ShardSpec, full_layout, local_slice, shard_spec
from slapo.verify import full_tensor, train_side_by_side

TOL = 1e-5


def _conv1d(nf, nx):
    from transformers.pytorch_utils import Conv1D

    return Conv1D(nf, nx)


class Block(nn.Module):
    """in (Conv1D, or Conv1DGeLU) -> out (Conv1D): Megatron's column-row pair, Conv1D style."""

    def __init__(self, hidden=16, inner=24, fuse_gelu=False):
        super().__init__()
        self.inp = _conv1d(inner, hidden)
        nn.init.normal_(self.inp.bias)  # nonzero biases: a bias added twice would show
        self.out = _conv1d(hidden, inner)
        nn.init.normal_(self.out.bias)
        if fuse_gelu:
            self.inp = Conv1DGeLU.from_conv1d(self.inp, "tanh")

    def forward(self, x):
        return self.out(self.inp(x))


def _loss(model, batch):
    out = model(batch["x"])
    return (out ** 2).mean(), out


def _column_row(sch, parts=1):
    sch["inp"].shard("weight", axis=1, parts=parts)
    sch["inp"].sync("bwd_post", "all_reduce")
    sch["out"].shard("weight", axis=0, parts=parts)  # its rows match the columns kept above
    sch["out"].sync("fwd_post", "all_reduce")


def _column_gathered(sch):
    sch["inp"].shard("weight", axis=1)
    sch["inp"].sync("bwd_post", "all_reduce")
    sch["inp"].sync("fwd_post", "all_gather", axis=-1, tensor_parallel_output_grad=False)


def _train(fuse_gelu, schedule):
    torch.manual_seed(0)
    plain = Block(fuse_gelu=fuse_gelu)
    sch = slapo.create_schedule(copy.deepcopy(plain))
    schedule(sch)
    scheduled = slapo.build_module(sch)
    batches = [{"x": torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(s))}
               for s in range(3)]
    facts = {"inp_nf": scheduled.inp.nf, "out_nx": scheduled.out.nx,
             "bias_spec": shard_spec(scheduled.inp.bias)}
    return facts, train_side_by_side(plain, scheduled, batches, _loss)


class LinearPair(nn.Module):
    """nn.Linear column (weight axis 0) and row (axis 1) pair, for ``parts`` on a Linear."""

    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(16, 24), nn.Linear(24, 16)

    def forward(self, x):
        return self.out(self.inp(x))


def _linear_in_parts():
    torch.manual_seed(0)
    plain = LinearPair()
    sch = slapo.create_schedule(copy.deepcopy(plain))
    sch["inp"].shard("weight", axis=0, parts=3)
    sch["inp"].sync("bwd_post", "all_reduce")
    sch["out"].shard("weight", axis=1, parts=3)
    sch["out"].sync("fwd_post", "all_reduce")
    scheduled = slapo.build_module(sch)
    batches = [{"x": torch.randn(3, 16, generator=torch.Generator().manual_seed(s))}
               for s in range(3)]
    return shard_spec(scheduled.inp.bias), train_side_by_side(plain, scheduled, batches, _loss)


def _refusals():
    found = {}
    tied = nn.Sequential(nn.Embedding(12, 4), nn.Linear(4, 12))
    tied[1].weight = tied[0].weight
    try:
        slapo.create_schedule(tied)["1"].shard("weight", axis=0, parts=3)
    except ValueError as err:
        found["embedding_parts"] = str(err)
    for name, axis, parts in (("uneven", 1, 1), ("uneven_parts", 1, 5)):
        sch = slapo.create_schedule(Block(inner=15))
        try:
            sch["inp"].shard("weight", axis=axis, parts=parts)
        except ValueError as err:
            found[name] = str(err)
    sch = slapo.create_schedule(Block(fuse_gelu=True))
    try:
        sch["inp"].shard("weight", axis=0)
    except ValueError as err:
        found["gelu_row"] = str(err)
    return found


def _numbered(module):
    """An initialiser whose every value names its position in the full tensor."""
    for param in module.parameters(recurse=False):
        param.copy_(torch.arange(param.numel(), dtype=param.dtype).view(param.shape))


def _initialised():
    """build's initialize on Conv1D shards (3 parts on the way in): each rank's slices of
    the full, initialised tensors; gathered back, they must be those full tensors."""
    sch = slapo.create_schedule(Block())
    _column_row(sch, parts=3)
    model = slapo.build_module(sch, init_weights=_numbered)
    return {name: full_tensor(param, param) for name, param in model.named_parameters()}


def _all_cases():
    return {
        "initialised": _initialised(),
        "column_row": _train(False, _column_row),
        "column_row_qkv_parts": _train(False, lambda s: _column_row(s, parts=3)),
        "column_gathered": _train(False, _column_gathered),
        "gelu_column_row": _train(True, _column_row),
        "linear_in_parts": _linear_in_parts(),
        "refusals": _refusals(),
    }


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all_cases)


@pytest.mark.parametrize("case", ["column_row", "column_row_qkv_parts", "column_gathered",
                                  "gelu_column_row"])
def test_conv1d_shards_equal_plain(results, case):
    for rank_results in results:
        facts, reports = rank_results[case]
        assert facts["inp_nf"] == 12
        if case != "column_gathered":
            assert facts["out_nx"] == 12
        parts = 3 if case == "column_row_qkv_parts" else 1
        assert facts["bias_spec"] == ShardSpec(0, 2, (24,), parts)
        for step, report in enumerate(reports):
            assert report.loss_error <= TOL, (case, step, report.loss_scheduled, report.loss_plain)
            assert report.output_error <= TOL, (case, step, report.output_error)
            name, err = report.max_grad_error
            assert err <= TOL, f"{case} step {step}: gradient of '{name}' off by {err:.2e}"


def test_build_initialises_conv1d_shards_at_full_shape(results):
    for rank_results in results:
        full = rank_results["initialised"]
        for name, shape in (("inp.weight", (16, 24)), ("inp.bias", (24,)),
                            ("out.weight", (24, 16)), ("out.bias", (16,))):
            expected = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
            assert torch.equal(full[name], expected), name


def test_linear_in_parts_equals_plain(results):
    for rank_results in results:
        bias_spec, reports = rank_results["linear_in_parts"]
        assert bias_spec == ShardSpec(0, 2, (24,), 3)  # the bias follows the weight's parts
        for step, report in enumerate(reports):
            assert report.loss_error <= TOL and report.output_error <= TOL, step
            assert report.max_grad_error[1] <= TOL, (step, report.max_grad_error)


def test_conv1d_refusals_name_the_parameter(results):
    found = results[0]["refusals"]
    assert "'1.weight'" in found["embedding_parts"]
    assert "one contiguous range" in found["embedding_parts"]
    assert "'inp.weight'" in found["uneven"] and "not divisible by 2" in found["uneven"]
    assert "3 parts" not in found["uneven"]
    assert "in 5 parts, each over 2 ranks" in found["uneven_parts"]
    assert "'inp.weight'" in found["gelu_row"] and "Conv1DGeLU" in found["gelu_row"]


def test_parts_layout_round_trip():
    """A rank's slice of every part, and the gathered slices put back in the full order."""
    full = torch.arange(12.0).view(1, 12)  # parts [0..3], [4..7], [8..11]
    spec = ShardSpec(axis=1, world_size=2, full_shape=(1, 12), parts=3)
    slices = [local_slice(full, spec, rank) for rank in range(2)]
    assert slices[0].tolist() == [[0, 1, 4, 5, 8, 9]]
    assert slices[1].tolist() == [[2, 3, 6, 7, 10, 11]]
    assert torch.equal(full_layout(torch.cat(slices, dim=1), spec), full)
