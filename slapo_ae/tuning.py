"""A tuning experiment's spec: which case, which knobs, which values, which search.

One YAML file per tuning (``configs/autotune/<name>.yaml``; the name is the file's stem)::

    case: "slapo-deepspeed wideresnet-2.4B 4 1 0 batch_size ckpt_ratio"
    symbols:
      batch_size: {from: 96, to: 192, step: 8, memory: increasing}
      ckpt_ratio: {values: [1.0, 0.92, 0.84, 0.67, 0.5, 0.34, 0.25], memory: decreasing}
    constraints: ["batch_size % n == 0"]
    strategies: [prune, grid]
    along: batch_size
    parallel: 1
    steps: 10            # optional: the trials' steps and warm-up (default: the profile's)
    warmup: 2
    memory_per_rank: 2048   # optional: MiB each rank may hold (CPU: a real out-of-memory)

- ``case``: one cfg line (docs/harness.md) with one GPU count, whose BATCH_SIZE is an
  expression of ``n`` (the GPUs) and the symbols, and whose CKPT is a symbol or a value.
- ``symbols``: each a list of ``values`` or an inclusive range ``from``/``to``/``step``, with
  its ``memory`` order (``increasing``, ``decreasing``; see :mod:`slapo.autotune.space`).
- ``constraints``: expressions of the symbols and ``n`` that a point must meet (the safe
  evaluator, :func:`slapo_ae.expr.evaluate_in`); a point whose case is invalid (a batch its
  data-parallel ranks cannot split) is an error unless a constraint leaves it out.
- ``strategies``: ``prune`` and/or ``grid``; the first chooses the tuned configuration, the
  others are run beside it for comparison (their trials are the same cached cases).
- ``along``, ``parallel``: the pruning search's symbol and lines probed per round.

This module reads and checks the spec and maps a point to its :class:`~slapo_ae.case.Case`;
it imports neither torch nor ``slapo`` (the workflow's planner loads it). The search itself
is :mod:`slapo.autotune`, which the round jobs run (:mod:`slapo_ae.harness.tune`). A bad spec
raises :class:`TuningError` naming ``file:line``.
"""
from __future__ import annotations

import dataclasses
import itertools
import re
import shlex
from pathlib import Path

from slapo_ae import expr, textfile
from slapo_ae.case import MAX_MEMORY_PER_RANK, MAX_STEPS, Case
from slapo_ae.cfg import CfgError, parse_cfg_text

STRATEGIES = ("prune", "grid")
MEMORY_ORDERS = ("increasing", "decreasing")
KEYS = ("description", "case", "symbols", "constraints", "strategies", "along", "parallel",
        "steps", "warmup", "memory_per_rank")
MAX_POINTS = 10000  # a larger grid is a typo in a range
NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]*")
SYMBOL = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class TuningError(ValueError):
    """A malformed tuning spec (the message names ``file:line``)."""


@dataclasses.dataclass(frozen=True)
class TuningSymbol:
    name: str
    values: tuple
    memory: str | None


@dataclasses.dataclass(frozen=True)
class TuningSpec:
    """A checked tuning spec (see the module docstring); ``path`` as given."""

    name: str
    path: str
    template: Case  # the case line with placeholder batch and ckpt
    batch_expr: str
    ckpt_field: str
    symbols: tuple[TuningSymbol, ...]
    constraints: tuple[str, ...]
    strategies: tuple[str, ...]
    along: str
    parallel: int
    steps: int | None
    warmup: int | None
    memory_per_rank: int | None
    description: str = ""
    case_line: int = 0

    @property
    def symbol_names(self) -> list[str]:
        return [s.name for s in self.symbols]

    def satisfies_one(self, constraint: str, config: dict) -> bool:
        """Whether ``config`` meets ``constraint`` (``n`` bound to the case's GPUs)."""
        return bool(expr.evaluate_in(constraint, {**config, "n": self.template.gpus}))

    def satisfies(self, config: dict) -> bool:
        """Whether ``config`` meets every constraint."""
        return all(self.satisfies_one(text, config) for text in self.constraints)

    def points(self) -> list[dict]:
        """The valid configurations, the last symbol varying fastest (the grid order of
        :meth:`slapo.autotune.Space.configs` for the same symbols and constraints)."""
        grid = itertools.product(*(s.values for s in self.symbols))
        configs = (dict(zip(self.symbol_names, vals)) for vals in grid)
        return [c for c in configs if self.satisfies(c)]

    def case_for(self, config: dict) -> Case:
        """The benchmark case of one configuration (the memory cap included)."""
        env = {**config, "n": self.template.gpus}
        batch = expr.evaluate_in(self.batch_expr, env)
        ckpt = config[self.ckpt_field] if self.ckpt_field in config else self.ckpt_field
        t = self.template
        line = (f"{t.mode} {t.model} {t.gpus} {t.seq_len} {t.dec_seq_len} "
                f"{_token(batch)} {_token(ckpt)}")
        try:
            case = parse_cfg_text(line, self.path)[0]
        except CfgError as err:
            message = err.errors[0].split(": ", 1)[-1]
            raise TuningError(f"{self.path}:{self.case_line}: the point {config} gives the "
                              f"case '{line}': {message}; leave it out with a constraint "
                              "(e.g. 'batch_size % n == 0')") from None
        return dataclasses.replace(case, memory_per_rank=self.memory_per_rank,
                                   line=self.case_line)

    def cases(self) -> dict[str, tuple[dict, Case]]:
        """``{case_id: (config, case)}`` of every point."""
        return {case.id: (config, case)
                for config in self.points() for case in [self.case_for(config)]}


def _token(value) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) >= 1:
        return str(int(value))
    return str(value)


# -- reading the file ---------------------------------------------------------------------

def _load(path: Path):
    """The YAML value of ``path`` and the line of each key path (``("symbols", "b")`` -> 4)."""
    import yaml

    try:
        text = textfile.read_text(path)
    except OSError as err:
        raise TuningError(f"{path}: cannot read: {err.strerror or err}") from None
    except textfile.NotTextError as err:
        raise TuningError(str(err)) from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        value = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise TuningError(f"{where}: not valid YAML: {getattr(err, 'problem', None) or err}") \
            from None
    lines = {}

    def walk(node, key):
        lines[key] = node.start_mark.line + 1
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                lines[key + (k.value,)] = k.start_mark.line + 1
                walk(v, key + (k.value,))
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                walk(v, key + (i,))

    if node is not None:
        walk(node, ())
    return value, lines


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def load_tuning(path: str | Path, known_models=None) -> TuningSpec:
    """Read and check the tuning spec at ``path``; :class:`TuningError` names ``file:line``."""
    path = Path(path)
    data, lines = _load(path)

    def fail(key: tuple, message: str):
        where = lines.get(key) or lines.get(key[:1]) or 1
        label = ".".join(str(k) for k in key)
        raise TuningError(f"{path}:{where}: {label + ': ' if label else ''}{message}")

    name = path.stem
    if not NAME.fullmatch(name):
        fail((), f"the tuning's name {name!r} (the file's stem) must match {NAME.pattern}")
    if not isinstance(data, dict):
        fail((), "a tuning spec is a mapping of keys (case, symbols, ...)")
    unknown = [k for k in data if k not in KEYS]
    if unknown:
        fail((unknown[0],), f"unknown key; known: {', '.join(KEYS)}")
    for key in ("case", "symbols"):
        if key not in data:
            fail((), f"missing key {key!r}")

    symbols = []
    if not isinstance(data["symbols"], dict) or not data["symbols"]:
        fail(("symbols",), "a mapping of symbol names to their values")
    for sym, spec in data["symbols"].items():
        key = ("symbols", sym)
        if not isinstance(sym, str) or not SYMBOL.fullmatch(sym) or sym == "n":
            fail(key, "a symbol's name is an identifier other than n")
        if not isinstance(spec, dict):
            fail(key, "give {values: [...]} or {from: A, to: B, step: S}, and memory")
        extra = set(spec) - {"values", "from", "to", "step", "memory"}
        if extra:
            fail(key + (sorted(extra)[0],), "unknown key; known: values, from, to, step, memory")
        if "values" in spec:
            if {"from", "to", "step"} & set(spec):
                fail(key, "give either values or from/to/step, not both")
            values = spec["values"]
            if not isinstance(values, list) or not values or not all(map(_number, values)):
                fail(key + ("values",), "a non-empty list of numbers")
            if len(set(values)) != len(values):
                fail(key + ("values",), "a value is listed twice")
        else:
            bounds = [spec.get(k) for k in ("from", "to", "step")]
            if not all(isinstance(b, int) and not isinstance(b, bool) for b in bounds):
                fail(key, "from, to and step are integers (or give values: [...])")
            start, stop, step = bounds
            if step < 1 or stop < start:
                fail(key, f"the range from {start} to {stop} by {step} is empty")
            values = list(range(start, stop + 1, step))
        memory = spec.get("memory")
        if memory is not None and memory not in MEMORY_ORDERS:
            fail(key + ("memory",), f"one of {', '.join(MEMORY_ORDERS)}, got {memory!r}")
        symbols.append(TuningSymbol(sym, tuple(values), memory))
    names = [s.name for s in symbols]

    if not isinstance(data["case"], str):
        fail(("case",), "one cfg line: MODE MODEL GPUS SEQ_LEN DEC_SEQ_LEN BATCH_SIZE CKPT")
    try:
        tokens = shlex.split(data["case"], comments=True)
    except ValueError as err:
        fail(("case",), str(err))
    if len(tokens) != 7:
        fail(("case",), f"expected 7 fields (MODE MODEL GPUS SEQ_LEN DEC_SEQ_LEN BATCH_SIZE "
                        f"CKPT), got {len(tokens)}")
    batch_expr, ckpt_field = tokens[5], tokens[6]
    try:  # the line with a placeholder batch (n: divisible) and ckpt checks the other fields
        template = parse_cfg_text(" ".join(tokens[:5] + ["n", "0"]), str(path),
                                  known_models=known_models)
    except CfgError as err:
        fail(("case",), err.errors[0].split(": ", 1)[-1])
    if len(template) != 1:
        fail(("case",), f"GPUS {tokens[2]!r}: a tuning runs at one GPU count")
    try:
        expr.parse(batch_expr, tuple(names) + ("n",))
    except expr.ExpressionError as err:
        fail(("case",), f"BATCH_SIZE: {err}")
    if SYMBOL.fullmatch(ckpt_field) and ckpt_field not in names:
        fail(("case",), f"CKPT {ckpt_field!r} is no symbol; symbols: {', '.join(names)}")

    constraints = data.get("constraints") or []
    if not isinstance(constraints, list) or not all(isinstance(c, str) for c in constraints):
        fail(("constraints",), "a list of expressions, e.g. ['batch_size % n == 0']")
    for i, text in enumerate(constraints):
        try:
            expr.parse(text, tuple(names) + ("n",))
        except expr.ExpressionError as err:
            fail(("constraints", i), str(err))

    strategies = data.get("strategies", ["prune"])
    if (not isinstance(strategies, list) or not strategies
            or any(s not in STRATEGIES for s in strategies)
            or len(set(strategies)) != len(strategies)):
        fail(("strategies",), f"a list of {' and/or '.join(STRATEGIES)}, got {strategies!r}")
    along = data.get("along", names[0])
    if along not in names:
        fail(("along",), f"{along!r} is no symbol; symbols: {', '.join(names)}")
    if "prune" in strategies and next(s for s in symbols if s.name == along).memory is None:
        fail(("symbols", along), "the pruning search runs along this symbol: give its memory "
                                 "order (memory: increasing or decreasing)")
    ints = {}
    # the bounds of slapo-bench run, which every trial goes through
    for key, minimum, maximum in (("parallel", 1, None), ("steps", 1, MAX_STEPS),
                                  ("warmup", 0, None), ("memory_per_rank", 1, MAX_MEMORY_PER_RANK)):
        value = data.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < minimum or (maximum and value > maximum)):
            fail((key,), (f"an integer of {minimum} to {maximum}" if maximum else
                          f"an integer of at least {minimum}") + f", got {value!r}")
        ints[key] = value
    if (ints["steps"] is None) != (ints["warmup"] is None):
        fail(("steps",) if ints["steps"] is None else ("warmup",),
             "give steps and warmup together (or neither: the profile's)")
    if ints["steps"] is not None and ints["warmup"] >= ints["steps"]:
        fail(("warmup",), f"warmup ({ints['warmup']}) must be below steps ({ints['steps']})")

    spec = TuningSpec(name=name, path=str(path), template=template[0], batch_expr=batch_expr,
                      ckpt_field=ckpt_field, symbols=tuple(symbols),
                      constraints=tuple(constraints), strategies=tuple(strategies),
                      along=along, parallel=ints["parallel"] or 1, steps=ints["steps"],
                      warmup=ints["warmup"], memory_per_rank=ints["memory_per_rank"],
                      description=str(data.get("description", "")),
                      case_line=lines.get(("case",), 1))
    size = 1
    for s in symbols:
        size *= len(s.values)
    if size > MAX_POINTS:
        fail(("symbols",), f"{size} points: more than {MAX_POINTS} (a range too wide?)")
    try:
        points = spec.points()
    except expr.ExpressionError as err:
        fail(("constraints",), str(err))
    if not points:
        fail(("constraints",), "no point of the grid meets the constraints")
    try:
        spec.cases()  # every point must give a valid case
    except expr.ExpressionError as err:
        fail(("case",), f"BATCH_SIZE: {err}")
    return spec
