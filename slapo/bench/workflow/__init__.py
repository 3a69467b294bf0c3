"""The Snakemake workflow's Python side (the rules in ``workflow/rules/*.smk`` stay thin).

- :mod:`.setup`: the config and its profiles, GPU detection, the cases of each experiment and
  the files each case depends on (imported by ``workflow/rules/common.smk`` at DAG time; it
  imports neither torch nor pandas).
- :mod:`.gpu_slots`: a file-lock GPU slot allocator, so that concurrent jobs get disjoint
  ``CUDA_VISIBLE_DEVICES``.
- :mod:`.run_case`: runs one case through the harness CLI; always leaves one record.
- :mod:`.kick`: the ``kick_the_tires`` target (test summary + one smoke case).

The analysis steps live beside the harness: :mod:`slapo.bench.aggregate`,
:mod:`slapo.bench.plots`, :mod:`slapo.bench.table4`, :mod:`slapo.bench.claims`.
"""
