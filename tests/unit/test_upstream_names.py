"""Upstream Slapo's smaller names: slapo.logger, slapo.utils.common.get_hooks,
the RNG tracker's Megatron names, fuse(compiler="TorchScript"), slapo.op.Print,
slapo.op.cross_entropy.ParallelCrossEntropy,
FusedMLP(use_torchscript=), annotations as parameter attributes and metadata.param_tags."""

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import slapo
from slapo.logger import get_logger
from slapo.op import FusedMLP, Print
from slapo.random import (
    _CUDA_RNG_STATE_TRACKER,
    STREAM_SEED_OFFSET,
    CudaRNGStatesTracker,
    get_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
)
from slapo.utils.common import get_hooks


def test_logger_logs_on_the_ranks_named(caplog):
    logger = get_logger("slapo.test")
    with caplog.at_level(logging.INFO, logger="slapo.test"):
        logger.info("everywhere")
        logger.info("rank zero", ranks=0)  # one process: rank 0
        logger.info("rank one", ranks=1)
        logger.warning("listed", ranks=[1, 0])
    assert [r.getMessage() for r in caplog.records] == ["everywhere", "rank zero", "listed"]


def test_get_hooks_lists_the_module_hooks_by_kind():
    lin = nn.Linear(4, 4)
    assert get_hooks(lin) == {"fwd_pre": [], "fwd_post": [], "bwd_post": []}
    sch = slapo.create_schedule(lin)
    sch.sync("fwd_pre", lambda x: x)
    sch.sync("bwd_post", lambda mod, grad_in, grad_out: None)  # upstream's hook form
    lin.register_forward_hook(lambda mod, args, out: out)
    hooks = get_hooks(lin)
    assert [len(hooks[k]) for k in ("fwd_pre", "fwd_post", "bwd_post")] == [1, 1, 1]


def test_parallel_cross_entropy_where_upstreams_scripts_import_it():
    """Upstream's OPT example imports it from slapo.op.cross_entropy (until 2026-12-06 only
    slapo.op had it); on one process it is the per-token cross entropy, 0 where ignored."""
    from slapo.op.cross_entropy import ParallelCrossEntropy

    assert ParallelCrossEntropy is slapo.op.ParallelCrossEntropy
    torch.manual_seed(0)
    logits, labels = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    labels[0, 1] = -100
    torch.testing.assert_close(ParallelCrossEntropy()(logits, labels),
                               F.cross_entropy(logits.transpose(1, 2), labels, reduction="none"))


def test_megatron_names_of_the_rng_tracker():
    assert CudaRNGStatesTracker is type(get_cuda_rng_tracker())
    assert _CUDA_RNG_STATE_TRACKER is get_cuda_rng_tracker()
    tp_seed = model_parallel_cuda_manual_seed(123, tp_rank=1)
    assert tp_seed == 123 + STREAM_SEED_OFFSET + 1
    outside = torch.rand(3)
    with get_cuda_rng_tracker().fork("model-parallel-rng"):
        inside = torch.rand(3)
    assert torch.equal(inside, torch.rand(3, generator=torch.Generator().manual_seed(tp_seed)))
    assert torch.equal(outside, torch.rand(3, generator=torch.Generator().manual_seed(123)))


class BiasGeLUBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8, bias=False)
        self.bias = nn.Parameter(torch.randn(8))
        self.print = Print()

    def forward(self, x):
        y = F.gelu(self.linear(x) + self.bias)
        return self.print(y, "shape", y.shape)


def test_torchscript_fusion_and_print_stay_in_the_traced_graph(capsys):
    torch.manual_seed(0)
    model, x = BiasGeLUBlock(), torch.randn(2, 8)
    expected = model(x)
    capsys.readouterr()
    sch = slapo.create_schedule(model)
    sch.trace(flatten=True)
    assert "self.print" in sch.mod.code
    (match,) = sch.find(lambda x, bias: F.gelu(x + bias))
    fused = sch.fuse(match, compiler="TorchScript")
    assert isinstance(fused, torch.jit.ScriptModule)  # registered itself, as upstream's
    assert sch.mod.FusedModule_0 is fused
    out = slapo.build_module(sch)(x)
    assert torch.allclose(out, expected, atol=1e-6)
    assert "shape torch.Size([2, 8])" in capsys.readouterr().out  # printed when it ran
    with pytest.raises(ValueError, match="unknown compiler 'torchscipt'"):
        sch.fuse([], compiler="torchscipt")


def test_fused_mlp_takes_upstreams_torchscript_flag():
    torch.manual_seed(0)
    plain = FusedMLP(8, 16, "gelu_new", 0.0)
    scripted = FusedMLP(8, 16, "gelu_new", 0.0, use_torchscript=True)
    scripted.load_state_dict(plain.state_dict())
    x = torch.randn(2, 3, 8)
    assert torch.equal(plain(x), scripted(x))


def test_annotations_are_parameter_attributes_and_metadata_tags():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    sch = slapo.create_schedule(model)
    sch["0"].annotate("weight", "foo", "bar")
    assert sch.metadata.param_tags == {"foo"} and sch["1"].metadata.param_tags == frozenset()
    built = slapo.build_module(sch)
    assert built[0].weight.foo == "bar" and not hasattr(built[1].weight, "foo")
    assert slapo.get_annotations(built[0].weight) == {"foo": "bar"}
    sch["0"].replace(nn.Linear(4, 4))  # carried to the same-named parameter
    assert sch["0"].mod.weight.foo == "bar"
    with pytest.raises(ValueError, match="'shape' on 1.bias would hide the tensor attribute"):
        sch["1"].annotate("bias", "shape", (2,))
