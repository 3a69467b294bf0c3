"""slapo.autotune: the search space, its constraints, the grid and pruning searches, resuming
from recorded trials and choosing the best, all on deterministic synthetic evaluations."""
from __future__ import annotations

import json

import pytest

from slapo.autotune import (
    Database,
    GridSearch,
    PruningSearch,
    Space,
    Trial,
    Unsupported,
    best,
    evaluate_trial,
    tune,
)

BATCHES = list(range(96, 193, 8))  # the paper's grid (Figure 10)
RATIOS = [1.0, 0.92, 0.84, 0.67, 0.5, 0.34, 0.25]


def paper_space(gpus=4) -> Space:
    space = Space()
    space.create_symbol("batch_size", range(96, 193, 8), memory="increasing")
    space.create_symbol("ckpt_ratio", RATIOS, memory="decreasing")
    space.add_constraint(lambda c: c["batch_size"] % gpus == 0, f"divisible by {gpus}")
    return space


class Landscape:
    """A synthetic model: memory grows with the batch and falls with the ratio; a point past
    ``cap`` is out of memory; throughput grows with the batch and with less recomputation."""

    def __init__(self, cap=170.0, monotone=True):
        self.cap, self.monotone, self.calls = cap, monotone, []

    def memory(self, c) -> float:
        return c["batch_size"] * (1.6 - 0.6 * c["ckpt_ratio"])

    def value(self, c) -> float:
        v = 100 + 0.2 * c["batch_size"] + 20 * (1 - c["ckpt_ratio"])
        if not self.monotone and c["batch_size"] == 96:
            v += 50  # a bump at the smallest batch: on no line's frontier
        return v

    def __call__(self, config):
        self.calls.append(dict(config))
        if self.memory(config) > self.cap:
            raise MemoryError(f"{self.memory(config):.0f} > {self.cap}")
        return self.value(config)


def test_space_enumerates_valid_points_in_grid_order():
    space = Space()
    space.create_symbol("b", range(2, 9, 2), memory="increasing")
    space.create_symbol("r", [1.0, 0.5], memory="decreasing")
    space.add_constraint(lambda c: c["b"] % 4 == 0, "b divisible by 4")
    assert [len(s) for s in space.symbols] == [4, 2]
    assert space.configs() == [{"b": 4, "r": 1.0}, {"b": 4, "r": 0.5},
                               {"b": 8, "r": 1.0}, {"b": 8, "r": 0.5}]
    assert len(space.grid()) == 8
    assert space.key({"r": 0.5, "b": 4}) == "(b: 4, r: 0.5)"
    assert space.needs_at_least({"b": 8, "r": 0.5}, {"b": 4, "r": 1.0})
    assert not space.needs_at_least({"b": 8, "r": 1.0}, {"b": 4, "r": 0.5})


def test_symbols_refuse_bad_memory_orders_and_empty_values():
    space = Space()
    with pytest.raises(ValueError, match="memory must be one of"):
        space.create_symbol("b", [1], memory="up")
    with pytest.raises(ValueError, match="no values"):
        space.create_symbol("b", [])
    symbol = space.create_symbol("b", [1, 2, 2])
    symbol.add(3)
    symbol.add(1)
    assert symbol.vals == [1, 2, 3]


def test_grid_search_tries_every_valid_point_once():
    space = paper_space()
    land = Landscape()
    result = tune(space, land, GridSearch())
    assert len(land.calls) == len(result.trials) == result.grid_size == 13 * 7
    assert {t.status for t in result.trials} == {"ok", "oom"}
    assert result.best.config == max((c for c in space.configs() if land.memory(c) <= land.cap),
                                     key=land.value)


def test_pruning_search_finds_the_grid_best_with_fewer_trials_and_runs_no_pruned_point():
    space = paper_space()
    grid = tune(space, Landscape(), GridSearch())
    land = Landscape()
    result = tune(space, land, PruningSearch(along="batch_size"))
    assert result.best == grid.best
    assert len(land.calls) < len(grid.trials) / 2
    # no trial ran where an earlier out-of-memory trial had already ruled it out
    for i, trial in enumerate(result.trials):
        earlier_oom = [t for t in result.trials[:i] if t.status == "oom"]
        assert not any(space.needs_at_least(trial.config, t.config) for t in earlier_oom)
    # every line's frontier was measured: the largest fitting batch per ratio
    for ratio in RATIOS:
        fitting = [c for c in space.configs()
                   if c["ckpt_ratio"] == ratio and land.memory(c) <= land.cap]
        if fitting:
            frontier = max(fitting, key=lambda c: c["batch_size"])
            assert any(t.config == frontier and t.status == "ok" for t in result.trials)


def test_pruning_search_is_deterministic_and_a_pure_function_of_the_trials():
    space = paper_space()
    first, second = Landscape(), Landscape()
    tune(space, first, PruningSearch())
    tune(space, second, PruningSearch())
    assert first.calls == second.calls
    search = PruningSearch()
    trials = [evaluate_trial(Landscape(), c) for c in first.calls[:3]]
    assert search.propose(space, trials) == search.propose(space, list(trials))
    assert search.propose(space, trials)[0] == first.calls[3]


def test_pruning_search_misses_a_best_off_the_frontier_as_documented():
    """Assumption (2) of slapo.autotune.search: the value grows along the batch. A bump inside
    the fitting region is found by the grid, not by the pruning search."""
    space = paper_space()
    grid = tune(space, Landscape(monotone=False), GridSearch())
    pruned = tune(space, Landscape(monotone=False), PruningSearch())
    assert grid.best.config == {"batch_size": 96, "ckpt_ratio": 0.25}
    assert all(t.config["batch_size"] != 96 for t in pruned.trials)
    assert pruned.best.value < grid.best.value


def test_parallel_lines_propose_one_probe_per_line():
    space = paper_space()
    proposals = PruningSearch(parallel=3).propose(space, [])
    assert [p["ckpt_ratio"] for p in proposals] == [1.0, 0.92, 0.84]  # least memory first
    assert len({p["batch_size"] for p in proposals}) == 1
    with pytest.raises(ValueError, match="parallel"):
        PruningSearch(parallel=0)


def test_pruning_needs_the_memory_order_of_its_symbol():
    space = Space()
    space.create_symbol("batch_size", [1, 2])
    with pytest.raises(ValueError, match="memory order"):
        PruningSearch().propose(space, [])
    with pytest.raises(ValueError, match="lacks"):
        PruningSearch(along="micro").propose(space, [])


def test_a_line_where_nothing_fits_ends_after_its_probes():
    space = Space()
    space.create_symbol("batch_size", [1, 2, 4, 8], memory="increasing")
    space.create_symbol("ckpt_ratio", [1.0, 0.0], memory="decreasing")
    land = Landscape(cap=0.5)  # nothing fits
    result = tune(space, land, PruningSearch())
    assert result.best is None
    assert all(t.status == "oom" for t in result.trials)
    # a binary search down the least-memory line; its smallest point's OOM rules out the rest
    assert [c["batch_size"] for c in land.calls] == [4, 2, 1]
    assert {c["ckpt_ratio"] for c in land.calls} == {1.0}


def test_tune_resumes_from_its_database(tmp_path):
    space = paper_space()
    db = tmp_path / "tune.json"
    full = Landscape()
    expected = tune(space, full, PruningSearch())
    interrupted = Landscape()
    tune(space, interrupted, PruningSearch(), database=Database(db), max_trials=4)
    assert len(interrupted.calls) == 4 and len(json.loads(db.read_text())["trials"]) == 4
    resumed = Landscape()
    result = tune(space, resumed, PruningSearch(), database=Database(db))
    assert interrupted.calls + resumed.calls == full.calls  # nothing evaluated twice
    assert result.best == expected.best
    assert [t.config for t in Database(db).load()] == full.calls


def test_a_broken_database_is_an_error_naming_it(tmp_path):
    db = tmp_path / "tune.json"
    db.write_text("{\"trials\": [{\"config\": {}}]}")
    with pytest.raises(ValueError, match="tune.json: not a tuning database"):
        Database(db).load()


def test_failures_of_the_evaluation_are_trials_and_the_search_goes_on():
    assert evaluate_trial(lambda c: 3, {"b": 1}) == Trial({"b": 1}, "ok", 3.0)
    oom = evaluate_trial(lambda c: (_ for _ in ()).throw(MemoryError("big")), {"b": 1})
    assert oom.status == "oom" and "MemoryError: big" in oom.reason

    class OutOfMemoryError(RuntimeError):  # torch's name, without torch
        pass

    def raises(err):
        def evaluate(config):
            raise err
        return evaluate

    assert evaluate_trial(raises(OutOfMemoryError("cuda")), {}).status == "oom"
    assert evaluate_trial(raises(Unsupported("no")), {}).status == "unsupported"
    failed = evaluate_trial(raises(ValueError("bad")), {})
    assert failed.status == "failed" and failed.reason == "ValueError: bad"
    space = Space()
    space.create_symbol("b", [1, 2, 3])
    result = tune(space, lambda c: 1 / (c["b"] - 2), GridSearch())
    assert [t.status for t in result.trials] == ["ok", "failed", "ok"]
    assert result.best.config == {"b": 3}


def test_best_breaks_ties_by_grid_order_not_by_trial_order():
    space = Space()
    space.create_symbol("b", [1, 2, 3])
    trials = [Trial({"b": 3}, "ok", 5.0), Trial({"b": 2}, "ok", 5.0), Trial({"b": 1}, "oom")]
    assert best(trials, space).config == {"b": 2}
    assert best(trials).config == {"b": 3}
    assert best([Trial({"b": 1}, "oom")], space) is None
    with pytest.raises(ValueError, match="exactly when it is ok"):
        Trial({"b": 1}, "oom", 3.0)
