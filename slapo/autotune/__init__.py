"""Autotuning a schedule's knobs (the paper's third tool, Figure 10).

    from slapo.autotune import Space, PruningSearch, Database, tune

    space = Space()
    space.create_symbol("batch_size", range(96, 193, 8), memory="increasing")
    space.create_symbol("ckpt_ratio", [1.0, 0.92, 0.84, 0.67, 0.5, 0.34, 0.25],
                        memory="decreasing")
    space.add_constraint(lambda c: c["batch_size"] % 4 == 0, "batch divisible by 4 ranks")
    result = tune(space, evaluate, PruningSearch(along="batch_size"), Database("tune.json"))
    result.best.config, result.best.value

- :mod:`.space`: :class:`Space`, :class:`Symbol` (values, memory order) and constraints;
- :mod:`.search`: :class:`Trial`, the strategies :class:`GridSearch` and
  :class:`PruningSearch` (``propose(space, trials)``: a pure function of the trials so far,
  so a search resumes from its records) and :func:`best`;
- :mod:`.tune`: :func:`tune` (evaluate in this process), :class:`Database` (the trials in a
  JSON file, written as each ends).

The search itself is pure Python; the artifact's workflow runs the same strategies with each
trial a cached benchmark case (docs/workflow.md, "Autotuning").
"""

from .search import GridSearch, PruningSearch, Trial, best
from .space import Space, Symbol, cfg_dict_to_str
from .tune import Database, TuneResult, Unsupported, evaluate_trial, tune

STRATEGIES = {"grid": GridSearch, "prune": PruningSearch}

__all__ = ["STRATEGIES", "Database", "GridSearch", "PruningSearch", "Space", "Symbol", "Trial",
           "TuneResult", "Unsupported", "best", "cfg_dict_to_str", "evaluate_trial", "tune"]
