"""Benchmark: the host's time a training step takes, Slapo-TP's compiled regions against
hf-compile's one region, where compute is small (printed).

    python benchmarks/bench_host.py [--models bert-large-uncased,llama-1.1b] [--steps 30]
                                    [--warmup 5] [--width 64] [--json out.json]

On a GPU the CPU issues a step's kernels ahead of the GPU; a step whose launches take longer
than its kernels is bound by the host. Slapo-TP calls one ``torch.compile`` region per layer
(and the loss and BERT's head: 26 regions on bert-large), hf-compile one for the whole model,
and each region's call costs the host its guards, its runtime wrappers and its autograd node,
forward and backward. This measures that cost where it can be measured without a GPU: each
model at its real depth with its width cut to ``--width`` and a vocabulary of 512 words, on
the CPU, one thread, a batch of 2 x 16 tokens, so that the step's arithmetic is small beside
the host's work. Both variants train from the same weights, step by step in turn (a busy
machine slows both alike); a step is forward and backward (the optimizer is one fused kernel
on CUDA for both, and left out). Printed per model: each variant's median step in ms of wall
time and its range over the steps, and Slapo's over hf-compile's with its range, then the
load (``uptime``). On a CPU a region's kernels run in the call, so these figures include
their arithmetic, and a GPU's launches cost more host time than a CPU's kernel calls: a
proxy, to set beside a GPU step's length; the one-GPU check measures the host's lead itself
(its summary's "CPU wait ms").
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import time

import torch

import slapo
from slapo.model_schedule import schedule_model
from slapo_ae.harness.systems.support import NO_HF_SDPA
from slapo_ae.zoo import build_model, model_family, synthetic_batch

VOCAB = 512
# Config fields that set each family's width (hidden size, its FFN's, the LM head's input).
WIDTH_FIELDS = {
    "bert-large-uncased": lambda w: {"hidden_size": w, "intermediate_size": 4 * w},
    "EleutherAI/gpt-neo-1.3B": lambda w: {"hidden_size": w, "intermediate_size": 4 * w,
                                          "bos_token_id": 0, "eos_token_id": 0},  # in VOCAB
    "facebook/opt-1.3b": lambda w: {"hidden_size": w, "ffn_dim": 4 * w,
                                    "word_embed_proj_dim": w},
    "llama-1.1b": lambda w: {"hidden_size": w, "intermediate_size": 3 * w},
}


def variants(model: str, width: int) -> dict:
    overrides = {**WIDTH_FIELDS[model](width), "vocab_size": VOCAB}
    plain = build_model(model, **overrides)
    sch = slapo.create_schedule(copy.deepcopy(plain))
    schedule_model(sch, tensor_parallel=False, kernel_opt=True, device="cpu",
                   compile_layers=True)  # the CUDA choice, on CPU
    attention = "eager" if model_family(model) in NO_HF_SDPA else "sdpa"  # as hf-compile's
    hf = build_model(model, attn_implementation=attention, **overrides)
    hf.load_state_dict(plain.state_dict())
    return {"hf-compile": torch.compile(hf), "slapo-megatron": slapo.build_module(sch)}


def measure(model: str, width: int, steps: int, warmup: int) -> dict:
    models = variants(model, width)
    batch = synthetic_batch(next(iter(models.values())).config, 2, 16, 0)
    times = {name: [] for name in models}
    for step in range(warmup + steps):  # the first steps compile
        for name, module in models.items():
            start = time.perf_counter()
            module(**batch).loss.backward()
            elapsed = time.perf_counter() - start
            module.zero_grad(set_to_none=True)
            if step >= warmup:
                times[name].append(elapsed * 1e3)
    ratios = [s / h for s, h in zip(times["slapo-megatron"], times["hf-compile"])]
    return {"model": model, "width": width, "steps_ms": times,
            "median_ms": {name: statistics.median(t) for name, t in times.items()},
            "ratio": statistics.median(ratios), "ratio_range": (min(ratios), max(ratios))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(WIDTH_FIELDS))
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, width {args.width}, vocabulary {VOCAB}, "
          f"batch 2 x 16; median of {args.steps} steps after {args.warmup}; forward + backward, "
          "ms of wall time [range]", flush=True)
    rows = []
    for model in args.models.split(","):
        r = measure(model, args.width, args.steps, args.warmup)
        rows.append(r)
        cells = [f"{name} {r['median_ms'][name]:.1f} [{min(t):.1f}-{max(t):.1f}]"
                 for name, t in r["steps_ms"].items()]
        low, high = r["ratio_range"]
        print(f"{model}: " + ", ".join(cells)
              + f"; slapo-megatron / hf-compile {r['ratio']:.2f}x [{low:.2f}-{high:.2f}]",
              flush=True)
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"load: {load}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "load": load}, f, indent=1)


if __name__ == "__main__":
    main()
