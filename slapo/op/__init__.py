"""Library kernels for schedules: attention on SDPA, fused bias+GeLU, dropout drawn for
the device, vocabulary-parallel cross entropy. Schedules swap them in with ``replace``, or
with the installers that put one kernel everywhere it applies in a model (``use_sdpa``,
``use_device_dropout``, ``vocab_parallel_loss``: upstream Slapo's library had the same ops);
they are plain functions and modules, usable on their own. Each op picks its kernel by the
device its tensors are on (``kernel_choices``).

- ``attention`` / ``CoreAttention`` / ``hf_attention_forward`` / ``math_attention`` / ``use_sdpa``:
  ``sdpa.py``; which of SDPA's kernels it runs on, measured on the device: ``sdpa_backend.py``
- ``FlashAttention`` and its core ``FlashAttentionOp`` (upstream Slapo's attention modules, on
  SDPA): ``flash_attention.py``; ``slapo.op.attention.FlashAttentionOp``, upstream's import
  path, is the same class (``slapo.op.attention`` itself stays the function)
- ``bias_gelu`` / ``LinearGeLU`` / ``Conv1DGeLU`` (transformers' Conv1D) / ``kernel_compiler``
  (the backend for ``fuse``): ``gelu.py``
- ``dropout`` / ``Dropout`` / ``use_device_dropout``: ``dropout.py``
- ``vocab_parallel_cross_entropy`` / ``vocab_parallel_loss``, and the same loss compiled on
  unsharded logits, ``compiled_cross_entropy`` / ``compiled_loss``: ``cross_entropy.py``
- ``padded_linear`` / ``PaddedLinear`` / ``use_padded_vocab`` (the vocabulary projection's
  products on aligned shapes, CUDA): ``linear.py``
- upstream Slapo's names: ``FusedQKV``, ``FusedMLP``, ``LinearWithSeparateBias``,
  ``LinearWithSyncFunc``, ``LinearWithAct``, ``LinearWithDropout``, ``ParallelCrossEntropy``,
  ``Print``: ``upstream.py``
"""

from . import sdpa, sdpa_backend
from .cross_entropy import (
    LOSS_KINDS,
    ParallelCrossEntropy,
    compiled_cross_entropy,
    compiled_loss,
    vocab_parallel_cross_entropy,
    vocab_parallel_loss,
)
from .dropout import Dropout, dropout, dropout_kernel, use_device_dropout
from .flash_attention import FlashAttention, FlashAttentionOp
from .gelu import (
    LinearGeLU,
    bias_gelu,
    bias_gelu_kernel,
    compiled_kernel_state,
    gelu_approximation,
    kernel_compiler,
)
from .linear import (
    PaddedLinear,
    padded_linear,
    use_padded_vocab,
    vocab_projection_kernel,
)
from .sdpa import (
    SLAPO_ATTENTION,
    SLAPO_CORE_ATTENTION,
    CoreAttention,
    attention,
    hf_attention_forward,
    hf_core_attention_forward,
    math_attention,
    merge_masks,
    register_hf_attention,
    register_hf_core_attention,
    use_sdpa,
)
from .upstream import (
    FusedMLP,
    FusedQKV,
    LinearWithAct,
    LinearWithDropout,
    LinearWithSeparateBias,
    LinearWithSyncFunc,
    Print,
)

__all__ = ["Conv1DGeLU", "CoreAttention", "Dropout", "FlashAttention", "FlashAttentionOp",
           "FusedMLP", "FusedQKV",
           "LOSS_KINDS", "LinearGeLU", "LinearWithAct", "LinearWithDropout",
           "LinearWithSeparateBias", "LinearWithSyncFunc",
           "PaddedLinear", "ParallelCrossEntropy", "Print", "SLAPO_ATTENTION",
           "SLAPO_CORE_ATTENTION", "attention", "bias_gelu", "bias_gelu_kernel",
           "compiled_cross_entropy", "compiled_kernel_state", "compiled_loss", "dropout",
           "dropout_kernel", "gelu_approximation", "hf_attention_forward",
           "hf_core_attention_forward", "kernel_choices", "kernel_compiler", "math_attention",
           "merge_masks", "padded_linear", "register_hf_attention", "register_hf_core_attention",
           "use_device_dropout", "use_padded_vocab", "use_sdpa", "vocab_parallel_cross_entropy",
           "vocab_parallel_loss", "vocab_projection_kernel"]


def __getattr__(name: str):
    if name == "Conv1DGeLU":  # made on first use: it derives from transformers' Conv1D
        from . import gelu
        return gelu.Conv1DGeLU
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def kernel_choices(device_type: str, local_window: bool = False) -> dict[str, str]:
    """The kernel each op picks on ``device_type`` (for records): attention, its dropout,
    dropout elsewhere, and bias+GeLU. ``local_window``: the model has attention over a local
    window (GPT-Neo's local layers, a ``CoreAttention`` with a ``window``)."""
    attention_kernel = "scaled_dot_product_attention"
    if sdpa_backend.measures(device_type):
        attention_kernel += (" (on the kernel measured fastest at the first call of each "
                             "shape and mask)")
    if local_window and device_type in sdpa.BANDED_ON:
        attention_kernel += " (a local window: by chunks of the window, local_attention)"
    if device_type == "cpu":
        attention_kernel += " (written out, 16-bit-mask dropout, when training with dropout)"
    return {"attention": attention_kernel, "dropout": dropout_kernel(device_type),
            "bias_gelu": bias_gelu_kernel(device_type)}


def _upstream_attention_module() -> None:
    """``from slapo.op.attention import FlashAttentionOp`` (upstream's module path) without a
    submodule: one would replace the function ``slapo.op.attention`` on this package once
    imported. Registered in ``sys.modules`` only, which an import finds first and leaves the
    package's attribute alone."""
    import sys
    import types

    shim = types.ModuleType(f"{__name__}.attention", "upstream Slapo's slapo.op.attention")
    shim.FlashAttentionOp, shim.FlashAttention = FlashAttentionOp, FlashAttention
    sys.modules.setdefault(shim.__name__, shim)


_upstream_attention_module()

