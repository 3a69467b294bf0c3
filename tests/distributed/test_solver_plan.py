"""The plan of ``slapo.sharding.Solver`` applied on 2 gloo ranks: ``Solver.schedule()``'s
steps (``shard``, ``sync``), applied as they are to a fresh schedule of the same module,
compute the plain module's output. Upstream's cost model counts the forward's communication
only: a plan that splits rows against replicated weights (``SR x RR``, the MLP's optimum) gives
each rank the weight gradient of its rows alone, which nothing sums (docs/upstream.md), so the
forward is what the plan is checked on.

Tolerance: relative error ``||a - b|| / max(||b||, 1e-3)`` of the output at most 1e-5 (fp32).
"""

import copy

import pytest
import torch
from distributed import run_ranks
from tiny_modules import MLP
from torch import nn

import slapo
from slapo.verify import relative_error

pytest.importorskip("z3")

BS, SEQ, HIDDEN = 2, 8, 16


class Wide(nn.Module):
    """One linear whose optimum is column-parallel: shard the weight's rows and the bias,
    gather the output's last axis."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(HIDDEN, 4 * HIDDEN)

    def forward(self, x):
        return self.fc(x)


def _apply(sch, steps):
    for step in steps:
        assert step.primitive in ("shard", "sync"), step  # no graph-level reshard here
        getattr(sch[step.target], step.primitive)(**step.kwargs)


def _plan_and_run():
    from slapo.sharding import Solver
    torch.manual_seed(0)
    x = torch.randn(BS, SEQ, HIDDEN)  # the same on every rank (same seed)
    found = {}
    for name, make in (("mlp", lambda: MLP(HIDDEN, 4 * HIDDEN)), ("wide", Wide)):
        plain = make()
        traced = slapo.create_schedule(copy.deepcopy(plain))
        traced.trace()
        solver = Solver(traced.mod, p=2)
        solver.solve([x])
        steps = solver.schedule()
        sch = slapo.create_schedule(copy.deepcopy(plain))
        _apply(sch, steps)
        model = slapo.build_module(sch)
        found[name] = ([str(s) for s in steps], relative_error(model(x), plain(x)))
    return found


def test_the_solvers_plan_computes_the_plain_forward_on_two_ranks():
    for found in run_ranks(_plan_and_run):
        steps, error = found["mlp"]
        assert steps == ['sch["fc1"].sync(mode=\'fwd_pre\', sync_op_or_fn=\'RR->SR\')',
                         'sch["fc2"].sync(mode=\'fwd_post\', sync_op_or_fn=\'SR->RR\')']
        assert error <= 1e-5
        steps, error = found["wide"]
        assert steps[0].startswith('sch["fc"].shard(param_names=[\'weight\', \'bias\'], axis=0)')
        assert steps[1] == 'sch["fc"].sync(mode=\'fwd_post\', sync_op_or_fn=\'RS->RR\')'
        assert error <= 1e-5
