"""Trials and the strategies that choose them.

A :class:`Trial` is one evaluated configuration: its status (as a benchmark record's: ``ok``,
``oom``, ``failed``, ``unsupported``) and, when ``ok``, its value (higher is better, e.g.
samples/s). A strategy is a pure function of the space and the trials so far:
``strategy.propose(space, trials)`` returns the configurations to evaluate next (none: the
search is over). Because nothing else is kept between calls, a search resumes from its
recorded trials alone, in this process or in a workflow whose rounds are separate jobs.

- :class:`GridSearch`: every valid configuration, in one round.
- :class:`PruningSearch`: along one symbol whose memory grows with its value (the batch),
  a binary search per line (a setting of the other symbols, e.g. one checkpoint ratio) for
  the largest value that does not run out of memory, whose value it then measures. It
  assumes what upstream Slapo's tuner assumed: (1) memory is monotone in each symbol as the
  space declares (an ``oom`` rules out every point needing at least as much memory, on every
  line; an ``ok`` shows that every point needing at most as much fits), and (2) along the
  searched symbol the value grows while the trial fits, so each line's best is its largest
  fitting point. Where (2) fails the pruning search can miss the grid's best; the grid
  search assumes nothing.
"""
from __future__ import annotations

import dataclasses

from slapo.autotune.space import Space

STATUSES = ("ok", "oom", "failed", "unsupported")


@dataclasses.dataclass(frozen=True)
class Trial:
    """One evaluated configuration; ``value`` is set only for ``ok``."""

    config: dict
    status: str
    value: float | None = None
    reason: str = ""

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"trial status must be one of {STATUSES}, got {self.status!r}")
        if (self.status == "ok") != (self.value is not None):
            raise ValueError(f"a trial has a value exactly when it is ok: {self.status} with "
                             f"value {self.value!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Trial:
        return cls(config=dict(data["config"]), status=data["status"], value=data.get("value"),
                   reason=data.get("reason", ""))


def best(trials, space: Space | None = None) -> Trial | None:
    """The ``ok`` trial of the highest value, None without one. A tie goes to the
    configuration that comes first in ``space``'s grid order (without a space: in ``trials``'
    order), so the answer does not depend on the order the trials ran in."""
    ok = [t for t in trials if t.status == "ok"]
    if space is not None:
        order = {space.key(c): i for i, c in enumerate(space.grid())}
        ok.sort(key=lambda t: order.get(space.key(t.config), len(order)))
    return max(ok, key=lambda t: t.value, default=None)  # max keeps the first of a tie


class GridSearch:
    """Every valid configuration of the space not yet tried, all in one round."""

    name = "grid"

    def propose(self, space: Space, trials) -> list[dict]:
        tried = {space.key(t.config) for t in trials}
        return [c for c in space.configs() if space.key(c) not in tried]


class PruningSearch:
    """Binary search, line by line, for the largest ``along`` that fits (see the module
    docstring).

    Lines (the settings of the other symbols) are searched in order of increasing memory
    (e.g. checkpoint ratio 1.0 first), so that an ``oom`` found on one line bounds the lines
    after it. ``parallel`` lines are probed per round: 1 prunes the most; more give fewer,
    wider rounds where trials can run side by side (GPUs).
    """

    name = "prune"

    def __init__(self, along: str = "batch_size", parallel: int = 1):
        if parallel < 1:
            raise ValueError(f"parallel must be at least 1, got {parallel}")
        self.along = along
        self.parallel = parallel

    def lines(self, space: Space) -> list[list[dict]]:
        """The valid configurations grouped by the other symbols, each line in order of
        increasing memory along ``along``, the lines in order of increasing memory."""
        if self.along not in space.space:
            raise ValueError(f"the pruning search runs along {self.along!r}, which the space "
                             f"lacks; symbols: {', '.join(space.space)}")
        along = space[self.along]
        if along.memory is None:
            raise ValueError(f"the pruning search needs the memory order of {self.along!r} "
                             "(create_symbol(..., memory='increasing' or 'decreasing'))")
        others = [s for s in space.symbols if s.name != self.along]
        by_line: dict[tuple, list[dict]] = {}
        for config in space.configs():
            by_line.setdefault(tuple(config[s.name] for s in others), []).append(config)

        def value_order(symbol, value):  # increasing memory; no order: the declared one
            if symbol.memory is None:
                return symbol.vals.index(value)
            return value if symbol.memory == "increasing" else -value

        lines = []
        for key in sorted(by_line, key=lambda k: [value_order(s, v)
                                                  for s, v in zip(others, k)]):
            lines.append(sorted(by_line[key], key=lambda c: value_order(along, c[self.along])))
        return lines

    def propose(self, space: Space, trials) -> list[dict]:
        trials = list(trials)
        proposals = []
        for line in self.lines(space):
            probe = self._probe(space, line, trials)
            if probe is not None:
                proposals.append(probe)
                if len(proposals) == self.parallel:
                    break
        return proposals

    def _probe(self, space: Space, line: list[dict], trials: list[Trial]) -> dict | None:
        """The next point of ``line`` to evaluate, or None when the line is settled: its
        largest fitting point measured, or no point of it fitting."""
        tried = {space.key(t.config): t for t in trials}

        def fits(config) -> bool | None:
            trial = tried.get(space.key(config))
            if trial is not None:
                return trial.status == "ok"  # any other status: not here, at least
            if any(t.status == "ok" and space.needs_at_least(t.config, config) for t in trials):
                return True
            if any(t.status == "oom" and space.needs_at_least(config, t.config) for t in trials):
                return False
            return None

        known = [fits(c) for c in line]
        low = max((i for i, k in enumerate(known) if k), default=-1)  # largest known to fit
        high = next((i for i in range(low + 1, len(line)) if known[i] is False), len(line))
        if high > low + 1:  # unknown points between: bisect them (the upper middle)
            return line[(low + high + 1) // 2]
        if low >= 0 and space.key(line[low]) not in tried:
            return line[low]  # the line's frontier is known to fit: measure it
        return None
