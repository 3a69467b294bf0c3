"""Numerical verification: a scheduled model against the plain model it came from.

Both models train side by side on the same batches with SGD; after every step the losses,
the outputs and the gradient of every parameter (sharded ones gathered back to full shape)
are compared by relative error ``||a - b|| / max(||b||, 1e-3)``. Every rank computes the same
report.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from .primitives.shard import shard_spec
from .sharding import gather_sharded

# Floor of the denominator: a gradient that is mathematically zero (a key bias under softmax)
# is numerical noise of ~1e-8, so it is compared absolutely rather than relatively.
ERROR_FLOOR = 1e-3


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / max(||expected||, ERROR_FLOOR)``, computed in float64."""
    actual, expected = actual.detach().double(), expected.detach().double()
    if actual.shape != expected.shape:
        raise ValueError(f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    return (actual - expected).norm().item() / max(expected.norm().item(), ERROR_FLOOR)


def full_tensor(param: nn.Parameter, value: torch.Tensor, group=None) -> torch.Tensor:
    """``value`` (the parameter or its gradient) at the parameter's full, unsharded shape.
    A collective for sharded parameters: every rank must call it in the same order."""
    spec = shard_spec(param)
    return value.detach() if spec is None else gather_sharded(value, spec.axis, group)


@dataclass
class StepReport:
    """Errors of one training step: loss, output and each parameter's gradient."""
    loss_plain: float
    loss_scheduled: float
    output_error: float
    grad_errors: dict[str, float] = field(default_factory=dict)

    @property
    def loss_error(self) -> float:
        return abs(self.loss_scheduled - self.loss_plain) / max(abs(self.loss_plain), 1e-30)

    @property
    def max_grad_error(self) -> tuple[str, float]:
        name = max(self.grad_errors, key=self.grad_errors.get)
        return name, self.grad_errors[name]


def train_side_by_side(plain: nn.Module, scheduled: nn.Module, batches: Iterable[dict],
                       forward: Callable[[nn.Module, dict], tuple[torch.Tensor, torch.Tensor]],
                       lr: float = 0.1, group=None) -> list[StepReport]:
    """Train both models one SGD step per batch and report the errors of every step.

    ``forward(model, batch)`` returns ``(loss, output)``. Parameters are matched by name, so
    the scheduled model must keep the plain model's parameter names.
    """
    opt_plain = torch.optim.SGD(plain.parameters(), lr=lr)
    opt_sched = torch.optim.SGD(scheduled.parameters(), lr=lr)
    plain_params = dict(plain.named_parameters())
    reports = []
    for batch in batches:
        loss_p, out_p = forward(plain, batch)
        loss_s, out_s = forward(scheduled, batch)
        loss_p.backward()
        loss_s.backward()
        report = StepReport(loss_p.item(), loss_s.item(), relative_error(out_s, out_p))
        for name, param in scheduled.named_parameters():
            if name not in plain_params:
                raise KeyError(f"scheduled model has parameter '{name}' that the plain one lacks")
            expected = plain_params[name].grad
            grad = full_tensor(param, param.grad, group) if param.grad is not None else None
            if (grad is None) != (expected is None):
                raise AssertionError(f"gradient of '{name}' exists in only one model")
            if grad is not None:
                report.grad_errors[name] = relative_error(grad, expected)
        reports.append(report)
        opt_plain.step()
        opt_sched.step()
        opt_plain.zero_grad()
        opt_sched.zero_grad()
    return reports
