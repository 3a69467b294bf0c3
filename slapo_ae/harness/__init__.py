"""The benchmark harness: run one case on N ranks and leave exactly one record (docs/harness.md).

- :mod:`.cli`: the ``slapo-bench`` command (``cases``, ``run``).
- :mod:`.runner`: the workflow's case runner (GPU slots, offline environment, hard timeout,
  a record even when the harness dies).
- :mod:`.launch`: the parent of a run: the ranks (torchrun on several nodes), timeout, the
  record when ranks die.
- :mod:`.supervise`: the one supervisor of child process trees (sessions, timeouts, signals).
- :mod:`.worker`: one rank: build the system, train, rank 0 writes the record
  (:mod:`.deferred_compile`: ``torch.compile`` of library functions at their first call).
- :mod:`.systems`: one module per system (mode), behind a small interface.
- :mod:`.runspec`, :mod:`.threads`, :mod:`.metrics`, :mod:`.flops`, :mod:`.profiling`,
  :mod:`.gpu_slots`: a run's settings, its thread budget, what is measured and how.
"""
