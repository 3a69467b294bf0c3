"""Two results that used to go silently wrong, on 2 gloo ranks.

- A row-parallel shard (``axis=1``) of a Linear or convolution subclass that has a forward of
  its own and a bias would have run the base computation and lost the subclass's work: it is
  refused before any parameter changes. Subclasses without a forward of their own, and
  bias-free ones, shard and train like the plain model.
- A model created on the meta device, scheduled, then built with ``init_weights`` keeps every
  shard spec, annotation and weight tie (``to_empty`` would have made new parameters).
"""

import copy

import pytest
import torch
from distributed import run_ranks
from torch import nn

import slapo
from slapo.primitives.shard import shard_spec
from slapo.verify import train_side_by_side

TOL = 1e-5


class Doubling(nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


class Inherits(nn.Linear):
    pass


class DoublingConv(nn.Conv1d):
    def forward(self, x):
        return 2 * super().forward(x)


def _loss(model, batch):
    out = model(batch)
    return out.pow(2).mean(), out


def _batches(shape):
    return [torch.randn(*shape, generator=torch.Generator().manual_seed(s)) for s in range(3)]


def _megatron_pair(model):
    """Column-parallel ``model[0]``, row-parallel ``model[1]`` (the module under test)."""
    sch = slapo.create_schedule(model)
    sch["0"].shard("weight", axis=0)
    sch["0"].sync("bwd_post", "all_reduce")
    sch["1"].shard("weight", axis=1)
    sch["1"].sync("fwd_post", "all_reduce")
    return slapo.build_module(sch)


def _run_subclasses():
    refused = {}
    for name, module in (("linear", Doubling(8, 4)), ("conv", DoublingConv(8, 4, 3))):
        before = module.weight
        try:
            slapo.create_schedule(module).shard("weight", axis=1)
        except ValueError as err:
            refused[name] = (str(err), module.weight is before, shard_spec(module.weight))
    errors = {}
    for name, make in (("inherits", lambda: Inherits(8, 4)),
                       ("bias-free", lambda: Doubling(8, 4, bias=False))):
        torch.manual_seed(0)
        plain = nn.Sequential(nn.Linear(6, 8), make())
        reports = train_side_by_side(plain, _megatron_pair(copy.deepcopy(plain)),
                                     _batches((5, 6)), _loss)
        errors[name] = max(max(r.loss_error, r.output_error, r.max_grad_error[1])
                           for r in reports)
    return refused, errors


def test_row_parallel_shards_keep_a_subclass_computation_or_refuse():
    for refused, errors in run_ranks(_run_subclasses):
        message, unchanged, spec = refused["linear"]
        assert message.startswith("cannot shard '<root>.weight' along its input axis: "
                                  "Doubling overrides Linear.forward")
        assert unchanged and spec is None  # refused before the parameter was replaced
        assert refused["conv"][0].startswith("cannot shard '<root>.weight' along its input "
                                             "axis: DoublingConv overrides Conv1d.forward")
        assert errors["inherits"] <= TOL and errors["bias-free"] <= TOL, errors


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.proj = nn.Linear(8, 8)
        self.norm = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        hidden = self.proj(self.embed(ids))
        return self.head(self.norm(hidden.transpose(1, 2)).transpose(1, 2))


def _init(module):
    """Deterministic values, the same on every rank, whatever the shard."""
    for param in module.parameters(recurse=False):
        param.copy_(torch.linspace(-1, 1, param.numel()).reshape(param.shape))
    if isinstance(module, nn.BatchNorm1d):
        module.reset_running_stats()


def _schedule(model):
    sch = slapo.create_schedule(model)
    sch["proj"].annotate("weight", "tp", "column")
    sch["proj"].shard("weight", axis=0)
    sch["proj"].sync("fwd_post", "all_gather", axis=-1, tensor_parallel_output_grad=False)
    return slapo.build_module(sch, init_weights=_init, device="cpu")


def _run_meta():
    with torch.device("meta"):
        model = Tied()
    model = _schedule(model)
    on_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    spec = shard_spec(model.proj.weight)
    return {
        "on_meta": on_meta,
        "tied": model.head.weight is model.embed.weight,
        "spec": (spec.axis, spec.world_size, spec.full_shape) if spec else None,
        "annotations": slapo.get_annotations(model.proj.weight),
        "proj_shape": tuple(model.proj.weight.shape),
        "bias_spec": shard_spec(model.proj.bias) is not None,
        "output": model(torch.arange(12).reshape(2, 6)).detach(),
    }


def test_a_meta_model_built_with_init_weights_keeps_specs_annotations_and_ties():
    results = run_ranks(_run_meta)
    for got in results:
        assert got["on_meta"] == []
        assert got["tied"]
        assert got["spec"] == (0, 2, (8, 8)) and got["bias_spec"]
        assert got["annotations"] == {"tp": "column"}
        assert got["proj_shape"] == (4, 8)
    # both ranks compute the same, whole output from their shards
    torch.testing.assert_close(results[0]["output"], results[1]["output"], rtol=0, atol=0)


def test_meta_parameters_without_init_weights_are_an_error():
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="still on the meta device"):
        slapo.build_module(slapo.create_schedule(model))
