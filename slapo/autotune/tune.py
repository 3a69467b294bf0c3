"""Running a search in this process: evaluate, record every trial, resume from the records.

    def evaluate(config):            # a number (higher is better), or raise
        return run_training(batch_size=config["batch_size"], ckpt_ratio=config["ckpt_ratio"])

    result = tune(space, evaluate, PruningSearch(along="batch_size"),
                  database=Database("tune.json"))
    result.best.config, result.best.value

``evaluate`` returns the configuration's value (e.g. samples/s). When it raises, the trial
is recorded, not lost: ``MemoryError`` or an exception named ``OutOfMemoryError`` (torch's)
as ``oom``, :class:`Unsupported` as ``unsupported``, anything else as ``failed`` with the
error as its reason; the search goes on. With a :class:`Database`, every trial is written to
its file as soon as it ends, and a later :func:`tune` on the same file starts from them:
configurations already tried are not evaluated again.
"""
from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path

from slapo.autotune.search import GridSearch, Trial, best
from slapo.autotune.space import Space
from slapo.logger import get_logger

logger = get_logger(__name__)


class Unsupported(Exception):
    """Raised by an evaluation function for a configuration that cannot run at all."""


class Database:
    """Trials in a JSON file (``{"trials": [...]}``), rewritten whole on each commit (a
    temporary file renamed over it, so an interrupted tuning leaves the last good file)."""

    def __init__(self, db_file_name: str | os.PathLike | None = None):
        self.db_file_name = db_file_name
        self.trials: list[Trial] = []

    def load(self) -> list[Trial]:
        """The trials in the file (none if there is no file yet)."""
        path = Path(self.db_file_name) if self.db_file_name else None
        if path is not None and path.is_file():
            try:
                data = json.loads(path.read_text())
                self.trials = [Trial.from_dict(t) for t in data["trials"]]
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(f"{path}: not a tuning database: {err}") from None
            logger.info(f"loaded {len(self.trials)} trials from {path}")
        return list(self.trials)

    def commit(self, trial: Trial) -> None:
        """Add ``trial`` (replacing an earlier one of the same configuration) and save."""
        self.trials = [t for t in self.trials if t.config != trial.config] + [trial]
        if not self.db_file_name:
            return
        path = Path(self.db_file_name)
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"trials": [t.to_dict() for t in self.trials]}, indent=1)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "w") as handle:
                handle.write(text + "\n")
                handle.flush()
                os.fsync(handle.fileno())
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


@dataclasses.dataclass
class TuneResult:
    """What a search found: its best trial (None if none was ``ok``), every trial it used
    (those loaded from the database first), and the size of the space's valid grid."""

    best: Trial | None
    trials: list[Trial]
    grid_size: int


def evaluate_trial(evaluate, config: dict) -> Trial:
    """Run ``evaluate(config)`` and turn its outcome into a :class:`Trial`."""
    try:
        value = evaluate(dict(config))
    except Unsupported as err:
        return Trial(config, "unsupported", reason=str(err))
    except Exception as err:  # the trial failed; the search goes on
        oom = isinstance(err, MemoryError) or type(err).__name__ == "OutOfMemoryError"
        return Trial(config, "oom" if oom else "failed", reason=f"{type(err).__name__}: {err}")
    return Trial(config, "ok", value=float(value))


def tune(space: Space, evaluate, strategy=None, database: Database | None = None,
         max_trials: int | None = None) -> TuneResult:
    """Search ``space`` with ``strategy`` (default :class:`GridSearch`), evaluating each
    proposed configuration with ``evaluate``; stop when the strategy proposes nothing or after
    ``max_trials`` new trials."""
    strategy = strategy or GridSearch()
    trials = database.load() if database is not None else []
    new = 0
    while max_trials is None or new < max_trials:
        proposals = strategy.propose(space, trials)
        if not proposals:
            break
        tried = {space.key(t.config) for t in trials}
        for config in proposals:
            if space.key(config) in tried:  # a strategy never proposes a tried point
                raise RuntimeError(f"{type(strategy).__name__} proposed {space.key(config)} "
                                   "again")
            if max_trials is not None and new >= max_trials:
                break
            trial = evaluate_trial(evaluate, config)
            logger.info(f"{space.key(config)}: {trial.status}"
                        + (f" {trial.value:.4g}" if trial.value is not None else ""))
            trials.append(trial)
            new += 1
            if database is not None:
                database.commit(trial)
    return TuneResult(best=best(trials, space), trials=trials, grid_size=len(space.configs()))
