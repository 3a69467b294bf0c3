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


def test_analyze_tie_ranks_pairs_the_same_position_of_each_stage():
    groups = slapo.pipeline.analyze_tie_weights(_tied(2))
    assert slapo.pipeline.analyze_tie_ranks(groups, _Topo(dp=1, pp=2, tp=1)) == [[[0, 1]]]
    # pipe x data x tensor = 2 x 2 x 2: stage 0 holds ranks 0-3, stage 1 ranks 4-7
    assert slapo.pipeline.analyze_tie_ranks(groups, _Topo(dp=2, pp=2, tp=2)) == \
        [[[0, 4], [1, 5], [2, 6], [3, 7]]]
    with pytest.raises(ValueError, match="held by stage 1, but the topology has 1 stages"):
        slapo.pipeline.analyze_tie_ranks(groups, _Topo(dp=2, pp=1, tp=1))


def test_pipeline_keeps_upstream_names_over_its_two_modules():
    from slapo.pipeline import partition, runtime
    assert slapo.pipeline.split_stages is partition.split_stages
    assert slapo.pipeline.generate_pipeline_partition is partition.generate_pipeline_partition
    assert slapo.pipeline.build_pipeline is runtime.build_pipeline
    assert slapo.pipeline.analyze_tie_weights is runtime.analyze_tie_weights
