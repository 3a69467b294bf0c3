"""The benchmark harness of the artifact evaluation.

Data-side modules (they import neither torch nor pandas at module level):

- :mod:`slapo.bench.expr`: safe evaluator for batch-size expressions in the GPU count ``n``.
- :mod:`slapo.bench.cases`: the cfg file format, one benchmark case a line -> :class:`Case`.
- :mod:`slapo.bench.flops`: model FLOPs per sample (the paper's formula and variants).
- :mod:`slapo.bench.metrics`: samples/s, spread, TFLOPS, MFU, peak memory.
- :mod:`slapo.bench.record`: the per-case result record, written atomically.
- :mod:`slapo.bench.runspec`: one run's settings, passed from the parent to the ranks.

Running a case (docs/harness.md):

- :mod:`slapo.bench.cli`: the ``slapo-bench`` command (``cases``, ``run``).
- :mod:`slapo.bench.launch`: the parent: torchrun, timeout, the record when ranks die.
- :mod:`slapo.bench.worker`: one rank: build the system, train, rank 0 writes the record.
- :mod:`slapo.bench.systems`: one module per system (mode), behind a small interface.
"""
