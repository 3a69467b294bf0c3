"""The search space of a tuning: symbols (a schedule's knobs, each with its candidate values)
and constraints between them.

    space = Space()
    space.create_symbol("batch_size", range(96, 193, 8), memory="increasing")
    space.create_symbol("ckpt_ratio", [1.0, 0.92, 0.84, 0.67, 0.5, 0.34, 0.25],
                        memory="decreasing")
    space.add_constraint(lambda cfg: cfg["batch_size"] % 4 == 0, "batch divisible by 4 ranks")
    space.configs()   # every valid configuration, a dict per point, in grid order

``memory`` says how a trial's memory moves as the symbol's value grows: ``"increasing"``
(a larger batch needs more), ``"decreasing"`` (a larger checkpoint ratio needs less) or
``None`` (no order: two points compare only at the same value). The pruning search
(:mod:`slapo.autotune.search`) reads it; the grid search does not need it.

Pure Python: nothing here imports torch.
"""
from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterable

MEMORY_ORDERS = ("increasing", "decreasing", None)


class Symbol:
    """A tunable knob: a name and its candidate values, in the order given."""

    def __init__(self, name: str, vals: Iterable, memory: str | None = None):
        if memory not in MEMORY_ORDERS:
            raise ValueError(f"symbol {name!r}: memory must be one of {MEMORY_ORDERS}, "
                             f"got {memory!r}")
        self.name = name
        self.vals = []
        for val in vals:
            self.add(val)
        if not self.vals:
            raise ValueError(f"symbol {name!r} has no values")
        self.memory = memory

    def add(self, val) -> None:
        """Add a candidate value (a value already there is kept once)."""
        if val not in self.vals:
            self.vals.append(val)

    def __len__(self) -> int:
        return len(self.vals)

    def __repr__(self) -> str:
        order = f", memory={self.memory!r}" if self.memory else ""
        return f"Symbol({self.name!r}, {self.vals!r}{order})"


class Space:
    """Symbols by name (in creation order) and the constraints a configuration must meet."""

    def __init__(self):
        self.space: dict[str, Symbol] = {}
        self.constraints: list[tuple[Callable[[dict], bool], str]] = []

    def create_symbol(self, name: str, vals: Iterable, memory: str | None = None) -> Symbol:
        """Create (or re-create, with new values) the symbol ``name``."""
        self.space[name] = Symbol(name, vals, memory)
        return self.space[name]

    def add_constraint(self, check: Callable[[dict], bool], description: str = "") -> None:
        """Keep only the configurations for which ``check(config)`` is true."""
        self.constraints.append((check, description or getattr(check, "__name__", "?")))

    @property
    def symbols(self) -> list[Symbol]:
        return list(self.space.values())

    def __getitem__(self, name: str) -> Symbol:
        return self.space[name]

    def is_valid(self, config: dict) -> bool:
        return all(check(config) for check, _ in self.constraints)

    def grid(self) -> list[dict]:
        """Every combination of the symbols' values, the last symbol varying fastest."""
        names = list(self.space)
        return [dict(zip(names, vals))
                for vals in itertools.product(*(s.vals for s in self.space.values()))]

    def configs(self) -> list[dict]:
        """The valid configurations of :meth:`grid`, in its order."""
        return [config for config in self.grid() if self.is_valid(config)]

    def key(self, config: dict) -> str:
        """A configuration's stable name, e.g. ``(batch_size: 144, ckpt_ratio: 0.5)``."""
        return cfg_dict_to_str({name: config[name] for name in self.space})

    def needs_at_least(self, config: dict, other: dict) -> bool:
        """Whether ``config`` needs at least the memory of ``other``, by the symbols' memory
        orders (a symbol without one must have the same value in both)."""
        for name, symbol in self.space.items():
            mine, theirs = config[name], other[name]
            if symbol.memory == "increasing" and mine < theirs:
                return False
            if symbol.memory == "decreasing" and mine > theirs:
                return False
            if symbol.memory is None and mine != theirs:
                return False
        return True

    def clone(self) -> Space:
        return copy.deepcopy(self)

    def __repr__(self) -> str:
        inner = ",\n".join(f"    {s!r}" for s in self.space.values())
        return f"Space(\n{inner})"


def cfg_dict_to_str(config: dict) -> str:
    """``{"batch_size": 144, "ckpt_ratio": 0.5}`` -> ``(batch_size: 144, ckpt_ratio: 0.5)``."""
    return "(" + ", ".join(f"{k}: {v}" for k, v in config.items()) + ")"
