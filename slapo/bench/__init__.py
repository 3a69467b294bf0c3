"""The benchmark harness of the artifact evaluation.

Data-side modules (they import neither torch nor pandas at module level):

- :mod:`slapo.bench.expr`: safe evaluator for batch-size expressions in the GPU count ``n``.
- :mod:`slapo.bench.cases`: the cfg file format, one benchmark case a line -> :class:`Case`.
- :mod:`slapo.bench.flops`: model FLOPs per sample (the paper's formula and variants).
- :mod:`slapo.bench.metrics`: samples/s, spread, TFLOPS, MFU, peak memory.
- :mod:`slapo.bench.record`: the per-case result record, written atomically.
"""
