"""slapo-ae: the artifact evaluation of the Slapo paper, built on the ``slapo`` library.

Dependencies run one way: ``workflow/`` -> ``slapo_ae`` -> ``slapo`` (checked in CI by the
import contract in ``pyproject.toml``). Importing this package, or any module of it that the
planner or the analysis uses, never imports torch; the harness imports it in the ranks.

- :mod:`slapo_ae.case`: one benchmark case, its one encoding (argv, JSON, the record's
  ``case``); :mod:`slapo_ae.cfg`: the cfg file format; :mod:`slapo_ae.expr`: batch expressions.
- :mod:`slapo_ae.zoo`: the offline model zoo (configs in ``configs/models``).
- :mod:`slapo_ae.harness`: run one case on N ranks (CLI, case runner, launcher, worker,
  systems, thread budget, metrics).
- :mod:`slapo_ae.record`: the per-case record, its non-ok factory; :mod:`slapo_ae.atomic`: the
  one atomic file writer.
- :mod:`slapo_ae.analysis`: aggregates, figures, Table 4, claims, the GPU check.
- :mod:`slapo_ae.sources`: which source files a case or an aggregate depends on (the planner's
  rerun inputs); :mod:`slapo_ae.gpus`: GPUs visible; :mod:`slapo_ae.paths`: the checkout's
  layout.
"""
