"""Benchmark: the attention kernels Slapo's schedules choose, at the one-GPU check's shapes
(printed).

    python benchmarks/bench_attention.py [--rounds 5] [--scale 1] [--json out.json]

Two things, each forward and backward, on this machine's device (CUDA in bf16; CPU in fp32,
where ``--scale 8`` divides the batches by 8 to keep it short):

- SDPA's kernels for each model's attention without a mask, as ``slapo.op.sdpa_backend``
  measures them at a schedule's first call (cuDNN, flash, memory-efficient on CUDA; flash and
  math on CPU), the kernel SDPA picks by itself, and the order it would choose;
- GPT-Neo-1.3B's local layer (window 256, 1024 tokens): the dense call under the window's mask
  against ``slapo.op.sdpa.local_attention`` (by chunks of the window, each chunk call on its
  measured kernel where the device measures), interleaved round by round, the first round a
  warm-up; printed: the median of each and their ratio with its range over the rounds.

Then the load (``uptime``). No target: the figures say whether the choices are worth it on
this device.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

from slapo.op import merge_masks, sdpa_backend
from slapo.op.sdpa import local_attention

# name: batch, heads, kv heads, length, head dim, causal, dropout (configs/gpu_check/*.cfg)
SHAPES = {
    "bert-large": (32, 16, 16, 512, 64, False, 0.1),
    "gpt-neo-1.3B global": (8, 16, 16, 1024, 128, True, 0.0),
    "opt-1.3b": (8, 32, 32, 1024, 64, True, 0.0),
    "llama-1.1b": (8, 32, 4, 1024, 64, True, 0.0),
}
LOCAL = (8, 16, 1024, 128, 256)  # GPT-Neo-1.3B's local layers: batch, heads, length, dim, window


def bshd_stride(heads: int, length: int, dim: int) -> tuple[int, ...]:
    """A ``[B, S, heads * dim]`` projection viewed as ``[B, heads, S, dim]``."""
    return (length * heads * dim, dim, heads * dim, 1)


def sdpa_kernels(device: torch.device, dtype: torch.dtype, scale: int) -> dict:
    results = {}
    for name, (batch, heads, kv_heads, length, dim, causal, dropout) in SHAPES.items():
        call = sdpa_backend.AttentionCall(
            max(1, batch // scale), heads, kv_heads, length, length, dim,
            (bshd_stride(heads, length, dim),) + (bshd_stride(kv_heads, length, dim),) * 2,
            str(dtype).removeprefix("torch."), str(device), causal, dropout, None)
        results[name] = sdpa_backend.measure(call)
        times = ", ".join(f"{k} {v:.3g} ms" for k, v in results[name]["times_ms"].items())
        print(f"{name}: {times or 'none ran'}; SDPA's own pick: {results[name]['sdpa_own']}; "
              f"left out: {results[name]['excluded'] or 'none'}")
    return results


def local_layer(device: torch.device, dtype: torch.dtype, scale: int, rounds: int) -> dict:
    batch, heads, length, dim, window = LOCAL
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, grad = (torch.randn(max(1, batch // scale), heads, length, dim, device=device,
                                 dtype=dtype, generator=gen) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    mask = merge_masks(length, length, dtype, device, causal=True, window=window)
    ways = {
        "dense, window as mask": lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=1.0),
        "by chunks": lambda: local_attention(q, k, v, window, 1.0),
    }
    times = {name: [] for name in ways}
    for _ in range(rounds + 1):  # the first round warms up
        for name, run in ways.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            run().backward(grad)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[name].append((time.perf_counter() - start) * 1e3)
    times = {name: t[1:] for name, t in times.items()}
    ratios = [d / c for d, c in zip(times["dense, window as mask"], times["by chunks"])]
    for name, t in times.items():
        print(f"GPT-Neo local layer, {name}: median {statistics.median(t):.3g} ms "
              f"[{min(t):.3g}-{max(t):.3g}]")
    print(f"  dense / by chunks: {statistics.median(ratios):.2f}x "
          f"[{min(ratios):.2f}-{max(ratios):.2f}] over {rounds} rounds")
    for line in sdpa_backend.describe(sdpa_backend.measurements()):  # the chunks' own choices
        print(f"  {line}")
    return {"times_ms": times, "ratio": statistics.median(ratios)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--scale", type=int, default=None,
                        help="divide the batches by this (default: 1 on CUDA, 8 on CPU)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    scale = args.scale or (1 if device.type == "cuda" else 8)
    print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, "
          f"{dtype}, batches / {scale}, torch {torch.__version__}")
    figures = {"sdpa": sdpa_kernels(device, dtype, scale),
               "local": local_layer(device, dtype, scale, args.rounds)}
    load = os.getloadavg()
    print(f"load average: {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({**figures, "device": str(device), "load": load}, out, indent=1)


if __name__ == "__main__":
    main()
