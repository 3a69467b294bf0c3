"""Upstream Slapo's ``sch.metadata`` (tie weights, sharded parameters, pipeline cutting
levels) read from our state, and ``sync`` callables in upstream's hook form, in one
process."""

import pytest
import torch
from torch import nn

import slapo


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def test_metadata_tie_weights_and_shard():
    sch = slapo.create_schedule(Tied())
    weight = sch["embed"].mod.weight
    assert list(sch.metadata.tie_weights.items()) == [(weight, weight)]
    assert sch["layers.0"].metadata.tie_weights is not None
    assert sch["layers.0"].metadata.tie_weights.keys() == {weight}  # the whole model's
    assert dict(sch["embed"].metadata.primitives["shard"]) == {}

    sch["embed"].shard("weight", axis=0)
    sch["layers.1"].shard(["weight", "bias"], axis=0)
    sharded = sch["embed"].mod.weight
    assert sharded is not weight and sharded is sch["head"].mod.weight
    assert list(sch.metadata.tie_weights) == [sharded]
    assert dict(sch["embed"].metadata.primitives["shard"]) == {"weight": 0}
    assert dict(sch["head"].metadata.primitives["shard"]) == {"weight": 0}  # the same tensor
    assert dict(sch["layers.1"].metadata.primitives["shard"]) == {"weight": 0, "bias": 0}
    assert dict(sch.metadata.primitives["shard"]) == {}  # the root has no parameter itself
    with pytest.raises(TypeError):
        sch.metadata.primitives["shard"]["weight"] = 1  # a view: the primitives write state


def test_metadata_pipeline_cutting_levels():
    sch = slapo.create_schedule(Tied())
    sch.trace(flatten=False)
    assert dict(sch.metadata.primitives["cut_pipeline_stage"]) == {}
    sch["layers.1"].cut_pipeline_stage()
    sch["layers.0"].cut_pipeline_stage()
    levels = sch.metadata.primitives["cut_pipeline_stage"]
    assert dict(levels) == {"layers": True}  # upstream's key: the level the cuts are made at
    assert dict(sch["layers"].metadata.primitives["cut_pipeline_stage"]) == {"layers": True}
    assert dict(sch["layers.0"].metadata.primitives["cut_pipeline_stage"]) == {}
    assert dict(sch["head"].metadata.primitives["cut_pipeline_stage"]) == {}


def test_sync_hooks_in_upstream_form():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    expected = model(2 * x) + 1
    sch = slapo.create_schedule(model)
    calls = []
    sch["0"].sync("fwd_pre", lambda module, inputs: (inputs[0] * 2,))
    sch["1"].sync("fwd_post", lambda module, inputs, output: calls.append(module) or None)
    sch["1"].sync("fwd_post", lambda module, inputs, output: output + 1)
    sch["0"].sync("bwd_post", lambda module, grad_input, grad_output:
                  calls.append(grad_input[0].shape) or None)
    x.requires_grad_()
    out = model(x)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    assert calls == [model[1], torch.Size([3, 4])]


def test_sync_callable_of_neither_form_is_refused():
    sch = slapo.create_schedule(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(TypeError, match=r"sync at '0': a callable sync_op_or_fn takes one "
                                        r"tensor, or the arguments of a fwd_pre hook "
                                        r"\(module, input\); .*takes neither"):
        sch["0"].sync("fwd_pre", lambda module, inputs, output: None)
    with pytest.raises(ValueError, match="tensor_parallel_output_grad applies to 'all_gather' "
                                         "only, not to 'all_reduce'"):
        sch["0"].sync("fwd_post", "all_reduce", tensor_parallel_output_grad=False)
    with pytest.raises(ValueError, match="unknown sync op 'RS->SS' at '0'"):
        sch["0"].sync("fwd_post", "RS->SS")
    with pytest.raises(ValueError, match="'RS->SR' at '0' changes the gradient's shape"):
        sch["0"].sync("bwd_post", "RS->SR")
