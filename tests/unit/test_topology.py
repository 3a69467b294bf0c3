"""``slapo.Topology``'s rank layout (Megatron-LM's and DeepSpeed's: tensor ranks consecutive,
then data-parallel replicas, pipeline stages outermost) and its argument errors, without
processes. The groups themselves, on 4 gloo ranks, are in tests/static/test_static_3d.py."""

import pytest

import slapo
from slapo.topology import rank_lists


def test_layout_of_eight_ranks_is_deepspeeds():
    # the layout upstream Slapo documents for PipeModelDataParallelTopology(2, 2, 2)
    lists = rank_lists(dp=2, pp=2, tp=2)
    assert lists["tensor"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lists["pipe"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lists["data"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lists["stage"] == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize("dp,pp,tp", [(1, 2, 2), (2, 2, 1), (4, 1, 1), (1, 4, 1), (3, 2, 2)])
def test_every_rank_once_per_axis(dp, pp, tp):
    world = dp * pp * tp
    for axis, size in (("tensor", tp), ("pipe", pp), ("data", dp), ("stage", dp * tp)):
        groups = rank_lists(dp=dp, pp=pp, tp=tp)[axis]
        assert sorted(r for g in groups for r in g) == list(range(world)), axis
        assert {len(g) for g in groups} == {size}, axis
    assert rank_lists(dp=dp, pp=pp, tp=tp)["tensor"][0] == list(range(tp))  # consecutive


def test_bad_degrees_and_no_distributed_are_errors():
    with pytest.raises(ValueError, match="topology tp must be a positive int, got 0"):
        rank_lists(dp=2, tp=0)
    with pytest.raises(ValueError, match="topology pp must be a positive int, got 1.5"):
        slapo.Topology(pp=1.5)
    with pytest.raises(TypeError):
        slapo.Topology(2, 2, 1)  # the degrees are named: no confusing their order
    with pytest.raises(RuntimeError, match="needs torch.distributed initialised"):
        slapo.Topology(pp=2)
