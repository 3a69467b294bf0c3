"""Which of SDPA's kernels Slapo's attention runs on, measured on the device.

``torch.nn.functional.scaled_dot_product_attention`` picks its kernel by a priority that
PyTorch sets per build and GPU: flash attention first and cuDNN's attention behind the math
kernel (an opt-in) by default; cuDNN's first on sm90 and sm100 GPUs (H100, H200, B200) where
the bundled cuDNN is 9.15.1 or newer (torch 2.10 and later; the device machines' torch
2.11+cu130 is such a build), after fixes for lengths that are not multiples of 128. Which
kernel trains fastest at a shape is the GPU's to say: huggingface/transformers pull request
48163 (2026-08) measured cuDNN's 1.7x to 2.3x faster than flash for training shapes on Hopper
and slower on A100 (0.82x) and a Blackwell workstation card (0.88x), and was closed because
PyTorch already puts cuDNN first on Hopper builds whose cuDNN it trusts. So rather than a rule
per architecture, :func:`backend_order` measures, on a device in ``MEASURED_ON`` (CUDA; the
environment's ``SLAPO_SDPA_MEASURE`` names others, or none when empty), at the first call of
each shape (strides, mask and dtype included): the forward and backward of each backend in
``CANDIDATES`` that can serve the call, each checked against the definition, SDPA's math
kernel in float32 on the same inputs (relative error of the output and of the three input
gradients at most ``AGREEMENT``, without dropout; against the kernel SDPA picks by itself where
the float32 reference does not fit in memory), so that a kernel at fault at a shape, SDPA's own
pick included, is left out rather than taken as the reference; ordered by their median time
with the call's dropout, fastest first (SDPA's own pick first unless another is ``MARGIN``
faster). cuDNN's attention is left out where SDPA keeps it
behind its math kernel: the measurement reorders the kernels PyTorch trusts on the build and
GPU, and opts into none it does not. The record names SDPA's own pick beside the choice.
:func:`slapo.op.sdpa.scaled_dot_product_attention`, through which all of Slapo's attention
calls SDPA, runs it under that priority (``torch.nn.attention.sdpa_kernel(...,
set_priority=True)``, the math kernel last), so a call the first backend cannot serve falls
to the next.

Inside a ``torch.compile`` region the measurement runs once, while Dynamo traces the region:
:func:`backend_order` is a constant to it (``torch.compiler.assume_constant_result``), and the
chosen kernel is then part of the compiled graph. It draws its inputs from a generator of its
own and restores the device's random state, so the training's dropout masks are those it
would have without it; it runs in a thread of its own, out of reach of the caller's autograd
hooks (activation checkpointing's), autocast and dispatch modes. Each process (rank) measures
for itself. :func:`measurements` lists what was measured, for records.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import time
import warnings
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

CANDIDATES = {  # SDPBackend names; on CPU "FLASH_ATTENTION" is its own flash kernel
    "cuda": ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"),
    "cpu": ("FLASH_ATTENTION", "MATH"),
}
ENV = "SLAPO_SDPA_MEASURE"  # the device types to measure on, comma-separated; empty: none


def measured_on(value: str | None) -> tuple[str, ...]:
    """The device types named by ``SLAPO_SDPA_MEASURE`` (default: CUDA only)."""
    if value is None:
        return ("cuda",)
    types = tuple(t.strip() for t in value.split(",") if t.strip())
    unknown = [t for t in types if t not in CANDIDATES]
    if unknown:
        raise ValueError(f"{ENV}={value!r}: unknown device type(s) {', '.join(unknown)}; "
                         f"known: {', '.join(CANDIDATES)} (empty: measure nowhere)")
    return types


MEASURED_ON = measured_on(os.environ.get(ENV))
MARGIN = 0.05  # how much faster than SDPA's own pick a kernel must be to be chosen
AGREEMENT = 2e-2  # bf16 keeps 8 bits of mantissa: kernels that sum in other orders differ ~1e-3
WARMUP, REPEATS = 2, 5


@dataclass(frozen=True)
class AttentionCall:
    """An SDPA call: ``[batch, heads, q_len, head_dim]`` queries and ``[batch, kv_heads, k_len,
    head_dim]`` keys and values, with the strides of each (a model's are views of its
    projections' ``[batch, length, heads * head_dim]`` outputs, and cuDNN's kernels take some
    layouts only, or copy the others), and the shape and dtype of its mask, if any, and
    whether the mask requires a gradient (T5's position bias does; cuDNN's kernel refuses
    such a mask)."""

    batch: int
    heads: int
    kv_heads: int
    q_len: int
    k_len: int
    head_dim: int
    strides: tuple[tuple[int, ...], ...]  # of the query, key and value
    dtype: str  # "bfloat16", ...
    device: str  # "cuda:0", ...
    causal: bool
    dropout_p: float
    scale: float | None
    mask: tuple[tuple[int, ...], str, bool] | None = None  # (shape, dtype, requires grad)


_MEASURED: dict[AttentionCall, dict] = {}


def measures(device_type: str) -> bool:
    """Whether SDPA's kernel is measured for calls on ``device_type``."""
    return device_type in MEASURED_ON


@torch.compiler.assume_constant_result
def backend_order(batch: int, heads: int, kv_heads: int, q_len: int, k_len: int,
                  head_dim: int, strides: tuple[tuple[int, ...], ...], dtype: str, device: str,
                  causal: bool, dropout_p: float, scale: float | None,
                  mask: tuple[tuple[int, ...], str, bool] | None = None) -> tuple[str, ...]:
    """SDPBackend names for the call, fastest first, measured at its first call in this
    process (see the module docstring); empty when no candidate can serve it."""
    call = AttentionCall(batch, heads, kv_heads, q_len, k_len, head_dim, strides, dtype,
                         device, causal, dropout_p, scale, mask)
    if call not in _MEASURED:
        if torch._C._current_graph_task_id() != -1:
            # inside a backward (a checkpoint's recompute meeting a call its forward did not
            # make): on CUDA this runs on autograd's device thread, which the measurement's
            # own backward would wait for; SDPA picks by itself, nothing is recorded
            return ()
        # in a thread of its own: none of the caller's autograd hooks (checkpointing's
        # saved-tensor hooks, which would count the measurement's tensors as the layer's),
        # autocast, grad mode or dispatch modes (Dynamo's) reach it
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            _MEASURED[call] = pool.submit(measure, call).result()
    return _MEASURED[call]["order"]


def measurements() -> list[dict]:
    """Every call measured in this process: its shape, the candidates' median milliseconds
    (forward and backward), the ones left out and why, the kernel SDPA would have run by
    itself, and the order chosen."""
    return [{**asdict(call), **result} for call, result in _MEASURED.items()]


def describe(measured: list[dict]) -> list[str]:
    """One line per measured call, for a record's notes."""
    lines = []
    for m in measured:
        call = (f"[{m['batch']}, {m['heads']}, {m['q_len']}, {m['head_dim']}] {m['dtype']}"
                + (" causal" if m["causal"] else "")
                + (f" with a {m['mask'][1]} mask {list(m['mask'][0])}"
                   + (" that trains" if m["mask"][2] else "") if m["mask"] else ""))
        times = ", ".join(f"{name} {ms:.3g} ms" for name, ms in m["times_ms"].items())
        left_out = "; ".join(f"{name}: {why}" for name, why in m["excluded"].items())
        lines.append(
            f"SDPA kernel measured on {m['device']} for {call}, dropout {m['dropout_p']:g}, "
            f"forward and backward: {times or 'none ran'}"
            f" -> {m['order'][0] if m['order'] else 'SDPA default'}"
            f" (SDPA's own pick: {m['sdpa_own'] or 'none'}"
            + (f"; left out: {left_out})" if left_out else ")"))
    return lines


def measure(call: AttentionCall) -> dict:
    """Time and check every candidate backend for ``call`` (see the module docstring)."""
    device = torch.device(call.device)
    generator = torch.Generator(device=device).manual_seed(0)
    dtype = getattr(torch, call.dtype)

    def draw(heads, length, stride):
        shape = (call.batch, heads, length, call.head_dim)
        return torch.empty_strided(shape, stride, device=device, dtype=dtype).normal_(
            generator=generator)

    q_stride, k_stride, v_stride = call.strides
    q, k, v = (draw(call.heads, call.q_len, q_stride), draw(call.kv_heads, call.k_len, k_stride),
               draw(call.kv_heads, call.k_len, v_stride))
    grad = draw(call.heads, call.q_len, q_stride)  # as a model's output, a view of [B, Q, H*D]
    kwargs = {"attn_mask": _mask(call, generator), "is_causal": call.causal,
              "scale": call.scale, "enable_gqa": call.kv_heads != call.heads}
    times, excluded = {}, {}
    rng_devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=rng_devices), warnings.catch_warnings(), \
            torch.autocast(device.type, enabled=False), torch.enable_grad():
        warnings.simplefilter("ignore")  # SDPA warns of each backend that cannot serve
        try:
            reference = _forward_backward(None, q, k, v, grad, kwargs)
        except RuntimeError as err:  # out of memory, say: the call itself will tell
            return {"order": (), "times_ms": {}, "sdpa_own": None, "excluded": {
                "all": "SDPA's own kernel did not run: " + str(err).strip().splitlines()[0]}}
        against = "the float32 math kernel"
        try:
            reference = _float32_math(q, k, v, grad, kwargs)
        except RuntimeError:  # its [B, H, Q, K] scores in float32 did not fit
            against = "SDPA's own kernel (the float32 math kernel did not fit)"
        own = sdpa_pick(q, k, v, dict(kwargs, dropout_p=call.dropout_p))
        priority = sdpa_priority()  # read after SDPA's first call, where CUDA settles it
        for name in CANDIDATES.get(device.type, ()):
            if not trusted(name, priority):
                excluded[name] = ("SDPA keeps it behind its math kernel on this build and "
                                  "GPU (an opt-in); not opted into")
                continue
            backend = getattr(SDPBackend, name)
            try:
                result = _forward_backward(backend, q, k, v, grad, kwargs)
                error = max(_relative_error(a, b) for a, b in zip(result, reference))
                if error > AGREEMENT:
                    excluded[name] = f"relative error {error:.2g} against {against}"
                    continue
                timed = dict(kwargs, dropout_p=call.dropout_p)
                times[name] = _median_ms(
                    functools.partial(_forward_backward, backend, q, k, v, grad, timed), device)
            except RuntimeError as err:  # "No available kernel", or the kernel's own refusal
                excluded[name] = "cannot serve the call: " + str(err).strip().splitlines()[0]
    order = fastest_first(times, own)
    return {"order": order, "times_ms": {name: times[name] for name in order},
            "sdpa_own": own, "excluded": excluded}


def fastest_first(times: dict[str, float], own: str | None) -> tuple[str, ...]:
    """Backend names by their time, fastest first, except that SDPA's own pick ``own``, if
    timed, stays first unless another is faster by more than ``MARGIN``: a choice that noise
    could flip would differ from run to run and rank to rank."""
    order = sorted(times, key=times.get)
    if own in times and times[own] <= times[order[0]] * (1 + MARGIN):
        order.remove(own)
        order.insert(0, own)
    return tuple(order)


def sdpa_priority() -> tuple[str, ...]:
    """SDPA's backend priority in this process (SDPBackend names): the one ``sdpa_kernel``
    reads and sets. On CUDA, PyTorch settles its default at SDPA's first call."""
    return tuple(SDPBackend(i).name for i in torch._C._get_sdp_priority_order())


def trusted(name: str, priority: tuple[str, ...]) -> bool:
    """Whether SDPA would try ``name`` before its math kernel. PyTorch keeps cuDNN's attention
    behind math (to be opted into) on builds and GPUs whose cuDNN it does not prefer."""
    return name == "MATH" or priority.index(name) < priority.index("MATH")


def sdpa_pick(q, k, v, kwargs: dict) -> str | None:
    """The kernel SDPA runs by itself for these inputs (its priority and its checks), as an
    SDPBackend name; None where it names none."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))  # as in training
    try:
        choice = SDPBackend(int(torch._fused_sdp_choice(q, k, v, **kwargs))).name
    except RuntimeError:  # SDPA ran the call, so this is not expected; the record says none
        return None
    return None if choice == "ERROR" else choice


def _mask(call: AttentionCall, generator: torch.Generator) -> torch.Tensor | None:
    """A mask of the call's shape and dtype, requiring a gradient where the call's does: the
    kernels' time does not depend on what it masks. Boolean: each key kept with probability
    1/2, the first always (no empty row); additive: normal scores."""
    if call.mask is None:
        return None
    shape, dtype, trains = call.mask
    device = torch.device(call.device)
    if dtype == "bool":
        keep = torch.rand(shape, device=device, generator=generator) < 0.5
        keep[..., 0] = True
        return keep
    bias = torch.randn(shape, device=device, dtype=getattr(torch, dtype), generator=generator)
    return bias.requires_grad_(trains)


def _forward_backward(backend, q, k, v, grad, kwargs) -> tuple[torch.Tensor, ...]:
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    if backend is None:
        out = F.scaled_dot_product_attention(q, k, v, **kwargs)
    else:
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(q, k, v, **kwargs)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def _float32_math(q, k, v, grad, kwargs) -> tuple[torch.Tensor, ...]:
    """The call's forward and input gradients by SDPA's math kernel in float32."""
    mask = kwargs["attn_mask"]
    if mask is not None and mask.is_floating_point():
        mask = mask.detach().float().requires_grad_(mask.requires_grad)
    return _forward_backward(SDPBackend.MATH, *(t.float() for t in (q, k, v, grad)),
                             dict(kwargs, attn_mask=mask))


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _median_ms(run, device: torch.device) -> float:
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(WARMUP):  # cuDNN builds its execution plans at the first calls
        run()
    times = []
    for _ in range(REPEATS):
        sync()
        start = time.perf_counter()
        run()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]
