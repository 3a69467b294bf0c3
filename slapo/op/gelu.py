"""Fused bias + GeLU: ``gelu(x + bias)`` in one kernel, and a Linear that uses it.

The fused kernel is ``torch.compile`` of the eager expression, compiled lazily on first use
(one compilation per GeLU flavour; Inductor fuses the add, the GeLU and their backward into
single elementwise kernels). Whether to compile is decided per call:

- ``SLAPO_COMPILE_KERNELS=1``: always compile; ``=0``: never; unset or ``auto``: compile for
  CUDA tensors only (on CPU the first compilation costs seconds to minutes, while the eager
  expression is already one vectorised loop per op);
- a ``compile=`` argument overrides the environment for that call.

If compilation fails on the platform (no C++ compiler, unsupported backend, ...) the failure is
logged once, in a line that starts ``slapo.op.gelu: torch.compile failed``, and the eager
expression is used from then on: the numbers are the same, only slower.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from ._adopt import adopt

logger = logging.getLogger(__name__)

ENV_COMPILE = "SLAPO_COMPILE_KERNELS"
_compiled: dict[str, object] = {}
_compile_failed: list[str] = []  # the logged reason, once compilation failed


def _bias_gelu_eager(x: torch.Tensor, bias: torch.Tensor, approximate: str) -> torch.Tensor:
    return F.gelu(x + bias, approximate=approximate)


def _bias_gelu_none(x, bias):
    return _bias_gelu_eager(x, bias, "none")


def _bias_gelu_tanh(x, bias):
    return _bias_gelu_eager(x, bias, "tanh")


_EAGER = {"none": _bias_gelu_none, "tanh": _bias_gelu_tanh}


def _want_compile(device_type: str, compile: bool | None) -> bool:
    if _compile_failed:
        return False
    if compile is not None:
        return compile
    setting = os.environ.get(ENV_COMPILE, "auto").strip().lower()
    if setting in ("1", "true", "yes"):
        return True
    if setting in ("0", "false", "no"):
        return False
    return device_type == "cuda"


def bias_gelu_kernel(device_type: str) -> str:
    """The kernel ``bias_gelu`` picks by default for tensors on ``device_type``."""
    return "torch.compile" if _want_compile(device_type, None) else "eager"


def kernel_compiler(device_type: str | None = None) -> str | None:
    """The ``torch.compile`` backend a schedule's ``fuse`` should use for elementwise
    kernels on ``device_type`` (default: ``"cuda"`` when a GPU is visible, else ``"cpu"``):
    ``"inductor"`` where ``SLAPO_COMPILE_KERNELS`` lets ``bias_gelu`` compile, None (the
    fused graph runs eagerly) elsewhere: the same rule, so both kernel paths agree."""
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return "inductor" if _want_compile(device_type, None) else None


def compiled_kernel_state() -> str:
    """``"compiled"`` if a compiled kernel ran, ``"failed: <reason>"`` if compilation failed,
    else ``"eager"``."""
    if _compile_failed:
        return f"failed: {_compile_failed[0]}"
    return "compiled" if _compiled else "eager"


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None, approximate: str = "none",
              compile: bool | None = None) -> torch.Tensor:
    """``gelu(x + bias)`` (``approximate``: ``"none"`` = erf GeLU, ``"tanh"`` = gelu_new).

    ``compile``: force (True) or forbid (False) the ``torch.compile`` kernel; None follows
    ``SLAPO_COMPILE_KERNELS`` (default: compile on CUDA only).
    """
    if approximate not in _EAGER:
        raise ValueError(f"unknown GeLU approximation {approximate!r}; expected 'none' or 'tanh'")
    if bias is None:
        return F.gelu(x, approximate=approximate)
    if not _want_compile(x.device.type, compile):
        return _EAGER[approximate](x, bias)
    fn = _compiled.get(approximate)
    if fn is None:
        fn = _compiled[approximate] = torch.compile(_EAGER[approximate], dynamic=None)
    try:
        return fn(x, bias)
    except Exception as err:  # noqa: BLE001 - any backend failure falls back to eager
        reason = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        _compile_failed.append(reason)
        _compiled.clear()
        logger.warning("slapo.op.gelu: torch.compile failed on this platform (%s); "
                       "using the eager bias+GeLU from now on", reason)
        return _EAGER[approximate](x, bias)


def gelu_approximation(act: nn.Module) -> str | None:
    """The ``approximate`` flavour of a GeLU activation module (torch or transformers), or None
    when ``act`` is not a GeLU that ``bias_gelu`` reproduces.

    transformers' ``GELUActivation`` is the erf GeLU (``"none"``); ``NewGELUActivation``
    (``gelu_new``, GPT-2/GPT-Neo) and ``GELUTanh`` are the tanh approximation (``"tanh"``),
    which ``F.gelu(approximate="tanh")`` computes within float rounding of the Python formula.
    """
    if isinstance(act, nn.GELU):
        return act.approximate
    try:
        from transformers.activations import GELUActivation, GELUTanh, NewGELUActivation
    except ImportError:  # pragma: no cover - transformers is an optional dependency
        return None
    if isinstance(act, GELUActivation):
        return "none"
    if isinstance(act, (NewGELUActivation, GELUTanh)):
        return "tanh"
    return None


class LinearGeLU(nn.Linear):
    """``gelu(x @ W^T + b)`` with the bias add and the GeLU fused (see ``bias_gelu``).

    ``LinearGeLU.from_linear(linear, approximate)`` reuses ``linear``'s parameters (same
    objects, so sharded or tied parameters stay so); sharding its weight along axis 0 later
    works as for ``nn.Linear``.
    """

    approximate: str = "none"

    @classmethod
    def from_linear(cls, linear: nn.Linear, approximate: str = "none") -> LinearGeLU:
        if approximate not in _EAGER:
            raise ValueError(f"unknown GeLU approximation {approximate!r}")
        return adopt(cls, linear, ("in_features", "out_features", "weight", "bias"),
                     approximate=approximate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.epilogue(F.linear(x, self.weight))

    def epilogue(self, y: torch.Tensor) -> torch.Tensor:
        """What follows the matmul: the fused bias+GeLU (a column-parallel linear whose
        weight gradient is overlapped keeps it, ``slapo.sharding.overlap``)."""
        return bias_gelu(y, self.bias, self.approximate)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, gelu approximate={self.approximate!r}"


def _make_conv1d_gelu() -> type:
    """``Conv1DGeLU``, made on first use: it derives from transformers' ``Conv1D`` (so that
    transformers' initialisation and ``shard`` treat it as one), and slapo imports
    transformers only where a feature needs it."""
    from transformers.pytorch_utils import Conv1D

    class Conv1DGeLU(Conv1D):
        """``gelu(x @ W + b)`` for transformers' ``Conv1D`` (GPT-2's linear, weight
        ``(in, out)``), the bias add and the GeLU fused (see ``bias_gelu``).

        ``Conv1DGeLU.from_conv1d(conv, approximate)`` reuses ``conv``'s parameters (same
        objects) and its ``nf`` / ``nx``; ``shard("weight", axis=1)`` splits it by columns as
        a Conv1D (by rows it is refused: GeLU of a partial sum is not a partial sum).
        """

        approximate: str = "none"

        @classmethod
        def from_conv1d(cls, conv: nn.Module, approximate: str = "none") -> Conv1DGeLU:
            if approximate not in _EAGER:
                raise ValueError(f"unknown GeLU approximation {approximate!r}")
            return adopt(cls, conv, ("nf", "nx", "weight", "bias"), approximate=approximate)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return bias_gelu(torch.matmul(x, self.weight), self.bias, self.approximate)

        __repr__ = nn.Module.__repr__  # Conv1D's own leaves out the GeLU

        def extra_repr(self) -> str:
            return f"nf={self.nf}, nx={self.nx}, gelu approximate={self.approximate!r}"

    Conv1DGeLU.__module__, Conv1DGeLU.__qualname__ = __name__, "Conv1DGeLU"  # picklable
    return Conv1DGeLU


def __getattr__(name: str):
    if name == "Conv1DGeLU":
        globals()[name] = cls = _make_conv1d_gelu()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
