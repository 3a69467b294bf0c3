"""Benchmark: training-step time of each family, plain HF model vs the kernel-optimised schedule.

    python benchmarks/bench_schedules.py [--families bert,gpt_neo] [--sizes tiny,mid]
                                         [--steps 3] [--warmup 1] [--threads 1]
                                         [--clock cpu|wall]

One process, TP=1 (``schedule_model(..., tensor_parallel=False, kernel_opt=True)``: SDPA
attention and fused bias+GeLU; no sharding, no checkpointing). A step is forward + backward +
SGD update on a synthetic batch; the table shows the median of ``--steps`` timed steps after
``--warmup`` untimed ones, in milliseconds of this process's CPU time (``--clock cpu``, the
default: on a shared machine, wall time measures the other processes too; with one thread and
an idle machine the two agree) or of wall time (``--clock wall``). The variants take their
steps in turn, so that whatever slows the machine slows them alike. Variants:

- ``plain``: the model as the zoo builds it (HF eager attention);
- ``hf-sdpa``: the same model with transformers' own SDPA attention, where it has one;
- ``slapo``: the plain model with the family's kernel-optimised schedule.

Sizes: ``tiny`` is the family's ``*-tiny`` config; ``mid`` a real config cut to a few layers
and a smaller vocabulary (see ``MID``), so that a step takes seconds on a CPU core. Printed,
not asserted: CPU timings say little about GPUs (on CPU, SDPA runs its math or flash-CPU
kernel, and the fused GeLU stays eager unless ``SLAPO_COMPILE_KERNELS=1``).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import slapo
from slapo.model_schedule import schedule_model
from slapo_ae.zoo import build_model, num_parameters, synthetic_batch

TINY = {"bert": "bert-tiny", "roberta": "roberta-tiny", "gpt_neo": "gpt-neo-tiny",
        "opt": "opt-tiny", "t5": "t5-tiny", "llama": "llama-tiny",
        "wideresnet": "wideresnet-tiny"}
# name, config overrides, (batch, seq, decoder seq): real hidden sizes, 2 layers (T5: 1 encoder
# + 1 decoder block), vocabularies cut to 8192 so that the LM head does not dominate the step.
V = {"vocab_size": 8192}
MID = {
    "bert": ("bert-large-uncased", {"num_hidden_layers": 2, **V}, (2, 128, 0)),
    "roberta": ("roberta-large", {"num_hidden_layers": 2, **V}, (2, 128, 0)),
    "gpt_neo": ("EleutherAI/gpt-neo-1.3B", {"num_layers": 2, **V, "bos_token_id": 0,
                                            "eos_token_id": 0,
                                            "attention_types": [[["global", "local"], 1]]},
                (2, 128, 0)),
    "opt": ("facebook/opt-1.3b", {"num_hidden_layers": 2, **V}, (2, 128, 0)),
    "t5": ("t5-large", {"num_layers": 1, "num_decoder_layers": 1, **V}, (2, 128, 64)),
    "llama": ("llama-1.1b", {"num_hidden_layers": 2, **V}, (2, 128, 0)),
    "wideresnet": ("wideresnet-250M", {"layers": [1, 1, 1, 1], "image_size": 64}, (2, 1, 0)),
}
TINY_SHAPE = (2, 64, 32)
HF_SDPA = {"bert", "roberta", "opt", "t5", "llama"}


def _step(model, opt, batch, clock) -> float:
    start = clock()
    model(**batch).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return clock() - start


def _row(family: str, size: str, steps: int, warmup: int, clock) -> dict:
    if size == "tiny":
        name, overrides, (bs, seq, dec) = TINY[family], {}, TINY_SHAPE
        dec = dec if family == "t5" else 0
    else:
        name, overrides, (bs, seq, dec) = MID[family]
    plain = build_model(name, **overrides)
    batch = synthetic_batch(plain.config, bs, seq, dec)
    row = {"family": family, "size": size, "model": name, "params": num_parameters(plain),
           "shape": f"{bs}x{seq}" + (f"+{dec}" if dec else "")}
    models = {"plain": plain}
    if family in HF_SDPA:
        models["hf-sdpa"] = build_model(name, attn_implementation="sdpa", **overrides)
    sch = slapo.create_schedule(copy.deepcopy(plain))
    schedule_model(sch, tensor_parallel=False, shard_embedding=False, kernel_opt=True)
    models["slapo"] = slapo.build_module(sch)
    optims = {key: torch.optim.SGD(m.parameters(), lr=1e-3) for key, m in models.items()}
    # Round robin: one step of each variant in turn, so that a busy machine slows all alike.
    times = {key: [] for key in models}
    for i in range(warmup + steps):
        for key, model in models.items():
            elapsed = _step(model, optims[key], batch, clock)
            if i >= warmup:
                times[key].append(elapsed)
    row.update({key: statistics.median(t) for key, t in times.items()})
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(TINY))
    parser.add_argument("--sizes", default="tiny,mid")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                        help="cpu: this process's CPU time (robust to other load on the machine; "
                             "equals wall time for one idle thread); wall: elapsed time")
    args = parser.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} thread(s), median of {args.steps} steps "
          f"after {args.warmup} warm-up; step = forward + backward + SGD, milliseconds of "
          f"{args.clock} time", flush=True)
    header = (f"{'family':<11} {'size':<5} {'model':<24} {'params':>8} {'batch':>9} "
              f"{'plain':>9} {'hf-sdpa':>9} {'slapo':>9} {'speedup':>8}")
    print(header)
    print("-" * len(header))
    for size in args.sizes.split(","):
        for family in args.families.split(","):
            r = _row(family, size, args.steps, args.warmup, clock)
            sdpa = f"{r['hf-sdpa'] * 1e3:9.1f}" if "hf-sdpa" in r else f"{'-':>9}"
            print(f"{family:<11} {size:<5} {r['model']:<24} {r['params'] / 1e6:7.1f}M "
                  f"{r['shape']:>9} {r['plain'] * 1e3:9.1f} {sdpa} {r['slapo'] * 1e3:9.1f} "
                  f"{r['plain'] / r['slapo']:7.2f}x", flush=True)


if __name__ == "__main__":
    main()
