"""Lines of schedule code per model family (the paper's Table 4), counted two ways.

The artifact counted "the lines of each schedule file, leaving out lines that contain
``for``". Here the schedule file of a family is ``slapo/model_schedule/<family>.py`` and the
count covers the bodies of its module-level functions (the schedule itself and any helper
defined beside it), not the library it calls (``common.py``, ``slapo.op``, primitives).

``lines`` (the artifact's rule, made precise): physical source lines inside those function
bodies that are
  - not blank,
  - not comment-only (``# ...``),
  - not part of a docstring (a function's leading string literal),
  - not the ``def`` header (signature lines up to the colon),
  - and do not contain the word ``for`` (``\\bfor\\b``: loop headers and comprehensions; a
    name such as ``fork_rng`` or ``format`` does not count as ``for``. A literal substring
    match, ``count_source(..., for_pattern=FOR_SUBSTRING)``, would also drop such lines).
A statement continued over several physical lines counts once per line, as in the artifact.

``statements``: logical statements (Python ``ast.stmt`` nodes) in the same bodies, the
docstring left out; a compound statement (``if``, ``for``, ``with``) counts one plus the
statements of its body. This does not depend on formatting or on the ``for`` rule.

Run ``python -m slapo_ae.analysis.loc`` for the table.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

from slapo_ae import paths
from slapo_ae.sources import SCHEDULES
from slapo_ae.zoo.configs import FAMILIES

FOR_WORD = re.compile(r"\bfor\b")
FOR_SUBSTRING = re.compile("for")
# The paper's Table 4 (ASPLOS'24), for comparison.
PAPER_LOC = {"wideresnet": 12, "t5": 11, "roberta": 21, "llama": 11, "opt": 10, "bert": 21,
             "gpt_neo": 10}


@dataclass(frozen=True)
class LocCount:
    family: str
    path: str
    lines: int        # the artifact's rule (see the module docstring)
    statements: int   # logical statements
    functions: tuple[str, ...]
    paper: int | None = None


def _docstring_lines(fn: ast.FunctionDef) -> set[int]:
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        return set(range(body[0].lineno, body[0].end_lineno + 1))
    return set()


def _statements(nodes: list[ast.stmt]) -> int:
    total = 0
    for node in nodes:
        total += 1
        for field in ("body", "orelse", "finalbody", "handlers"):
            total += _statements(getattr(node, field, []) or [])
    return total


def count_source(source: str,
                 for_pattern: re.Pattern = FOR_WORD) -> tuple[int, int, tuple[str, ...]]:
    """``(lines, statements, function names)`` of the module-level functions in ``source``;
    lines matching ``for_pattern`` are left out of ``lines``."""
    tree = ast.parse(source)
    text = source.splitlines()
    lines = statements = 0
    names = []
    for fn in tree.body:
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        names.append(fn.name)
        skip = _docstring_lines(fn)
        first_body_line = fn.body[0].lineno
        for lineno in range(first_body_line, fn.end_lineno + 1):
            line = text[lineno - 1].strip()
            if not line or line.startswith("#") or lineno in skip or for_pattern.search(line):
                continue
            lines += 1
        body = fn.body[1:] if skip else fn.body
        statements += _statements(body)
    return lines, statements, tuple(names)


def schedule_path(family: str) -> Path:
    """The schedule file of ``family`` (:mod:`slapo_ae.sources` says where schedules live)."""
    return paths.ROOT / SCHEDULES / f"{family}.py"


def count_loc(family: str) -> LocCount:
    """Both counts for the schedule file of ``family``."""
    path = schedule_path(family)
    lines, statements, names = count_source(path.read_text())
    return LocCount(family, path.relative_to(paths.ROOT).as_posix(), lines, statements,
                    names, PAPER_LOC.get(family))



def count_all() -> list[LocCount]:
    """``count_loc`` of every family, in the zoo's family order."""
    return [count_loc(family) for family in FAMILIES]


def main() -> None:
    print(f"{'family':<12} {'lines (artifact rule)':>22} {'statements':>11} {'paper':>6}  file")
    for c in count_all():
        print(f"{c.family:<12} {c.lines:>22} {c.statements:>11} {c.paper or '-':>6}  {c.path}")


if __name__ == "__main__":
    main()
