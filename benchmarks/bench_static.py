"""Static-graph primitives on CPU: how long tracing takes, and what fusing bias+GeLU buys.

    python benchmarks/bench_static.py [--repeat 20] [--batch 8 --seq 512]

1. Trace time of one bert-large layer (hidden 1024, intermediate 4096, 16 heads), with the
   hierarchy kept (``flatten=False``) and flat, median of 3 traces of fresh copies.
2. bias + GeLU on a (batch, seq, 4096) activation: eager ``F.gelu(x + bias)`` against the
   module that ``decompose`` + ``find`` + ``fuse(compiler="inductor")`` make of a bert-large
   ``BertIntermediate``; forward, and forward + backward; median over ``--repeat`` calls after
   warm-up (the compile is excluded and reported separately).

Printed, not asserted: timings depend on the machine (threads: ``torch.get_num_threads()``).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import slapo  # noqa: E402


def bert_large_config():
    from transformers import BertConfig
    return BertConfig(hidden_size=1024, num_attention_heads=16, intermediate_size=4096,
                      num_hidden_layers=1, attn_implementation="eager")


def median_time(fn, repeat: int) -> tuple[float, float]:
    """Median and spread (max - min) of ``repeat`` calls, in seconds."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), max(times) - min(times)


def bench_trace() -> None:
    from transformers.models.bert.modeling_bert import BertLayer
    layer = BertLayer(bert_large_config())
    example = {"hidden_states": torch.randn(8, 512, 1024),
               "attention_mask": torch.zeros(8, 1, 512, 512)}
    print("1. trace of one bert-large layer (BertLayer, 1024/4096/16 heads)")
    for flatten in (False, True):
        times = []
        for _ in range(3):
            sch = slapo.create_schedule(copy.deepcopy(layer))
            start = time.perf_counter()
            sch.trace(flatten=flatten, example_inputs=example)
            times.append(time.perf_counter() - start)
        nodes = sum(len(m.graph.nodes) for m in sch.mod.modules()
                    if isinstance(m, torch.fx.GraphModule))
        print(f"   flatten={flatten!s:5}  median {statistics.median(times):6.3f} s "
              f"(min {min(times):.3f}, max {max(times):.3f})  graph nodes: {nodes}")


def bench_bias_gelu(batch: int, seq: int, repeat: int) -> None:
    from transformers.models.bert.modeling_bert import BertIntermediate
    sch = slapo.create_schedule(BertIntermediate(bert_large_config()))
    sch.trace()
    sch["dense"].decompose()
    match = sch.find(lambda x, bias: F.gelu(x + bias))[0]
    fused = sch.fuse(match, compiler="inductor", name="bias_gelu")
    bias = sch.mod.dense.decomposed_bias.detach()
    x = torch.randn(batch, seq, 4096)

    def eager(x, b):
        return F.gelu(x + b)

    print(f"2. bias + GeLU on ({batch}, {seq}, 4096) fp32, {torch.get_num_threads()} threads")
    start = time.perf_counter()
    fused(x, bias)
    compile_fwd = time.perf_counter() - start
    xg = x.clone().requires_grad_()
    bg = bias.clone().requires_grad_()
    start = time.perf_counter()
    fused(xg, bg).sum().backward()
    compile_bwd = time.perf_counter() - start
    print(f"   inductor compile (first calls): forward {compile_fwd:.1f} s, "
          f"forward+backward {compile_bwd:.1f} s")
    torch.testing.assert_close(fused(x, bias), eager(x, bias), rtol=1e-5, atol=1e-5)

    rows = []
    for label, fn in (("eager F.gelu(x + b)", eager), ("fused (inductor)", fused)):
        with torch.no_grad():
            fn(x, bias)
            fwd = median_time(lambda fn=fn: fn(x, bias), repeat)

        def train_step(fn=fn):
            xg.grad = bg.grad = None
            fn(xg, bg).sum().backward()
        train_step()
        both = median_time(train_step, repeat)
        rows.append((label, fwd, both))
    base_fwd, base_both = rows[0][1][0], rows[0][2][0]
    print(f"   {'':22s} {'forward ms':>12s} {'speedup':>8s} {'fwd+bwd ms':>12s} {'speedup':>8s}")
    for label, fwd, both in rows:
        print(f"   {label:22s} {fwd[0] * 1e3:9.2f}±{fwd[1] * 1e3:<5.1f}"
              f"{base_fwd / fwd[0]:6.2f}x {both[0] * 1e3:9.2f}±{both[1] * 1e3:<5.1f}"
              f"{base_both / both[0]:6.2f}x")
    print("   (± is the spread, max - min, of the timed calls)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{os.cpu_count()} CPUs")
    bench_trace()
    bench_bias_gelu(args.batch, args.seq, args.repeat)


if __name__ == "__main__":
    main()
