"""Lines of schedule code per model family (the paper's Table 4), counted two ways.

The artifact counted "the lines of each schedule file, leaving out lines that contain
``for``". Here the schedule file of a family is ``slapo/model_schedule/<family>.py`` and the
count covers the bodies of its module-level functions (the schedule itself and any helper or
pattern defined beside it) **and of every project helper it calls**: a function of the
schedule package (``slapo/model_schedule/common.py``, ``__init__.py``) that the schedule
imports and calls is counted with it, followed through the calls those helpers make, each
function once. The library a schedule uses (the primitives, ``slapo.op``'s kernels, the
sharding collectives) is not counted, as upstream Slapo's library was not.

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
    functions: tuple[str, ...]  # defined in the schedule file
    helpers: tuple[str, ...] = ()  # project helpers counted with it, "<module>.<function>"
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


Function = ast.FunctionDef | ast.AsyncFunctionDef


def _functions(tree: ast.Module) -> dict[str, Function]:
    return {fn.name: fn for fn in tree.body if isinstance(fn, (ast.FunctionDef,
                                                                ast.AsyncFunctionDef))}


def _count_function(fn: Function, text: list[str], for_pattern: re.Pattern) -> tuple[int, int]:
    skip = _docstring_lines(fn)
    lines = 0
    for lineno in range(fn.body[0].lineno, fn.end_lineno + 1):
        line = text[lineno - 1].strip()
        if line and not line.startswith("#") and lineno not in skip \
                and not for_pattern.search(line):
            lines += 1
    return lines, _statements(fn.body[1:] if skip else fn.body)


def count_source(source: str,
                 for_pattern: re.Pattern = FOR_WORD) -> tuple[int, int, tuple[str, ...]]:
    """``(lines, statements, function names)`` of the module-level functions in ``source``;
    lines matching ``for_pattern`` are left out of ``lines``."""
    text = source.splitlines()
    lines = statements = 0
    functions = _functions(ast.parse(source))
    for fn in functions.values():
        counted = _count_function(fn, text, for_pattern)
        lines, statements = lines + counted[0], statements + counted[1]
    return lines, statements, tuple(functions)


def _package_imports(tree: ast.Module, package: Path) -> dict[str, tuple[Path, str]]:
    """The names a module imports from its own package (``from . import f``,
    ``from .common import g``): name -> (module file, function name)."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            module = package / ((node.module or "__init__").replace(".", "/") + ".py")
            for alias in node.names:
                found[alias.asname or alias.name] = (module, alias.name)
    return found


def _names_used(fn: Function) -> set[str]:
    return {node.id for node in ast.walk(fn) if isinstance(node, ast.Name)}


def called_helpers(path: Path) -> list[tuple[Path, str]]:
    """The project helpers (functions of ``path``'s package) that the functions of ``path``
    use, directly or through other helpers: (module file, function name), in the order
    they are first reached."""
    package = path.parent
    parsed: dict[Path, ast.Module] = {}

    def tree(module: Path) -> ast.Module:
        if module not in parsed:
            parsed[module] = ast.parse(module.read_text())
        return parsed[module]

    reached: list[tuple[Path, str]] = []
    todo = [(path, name) for name in _functions(tree(path))]
    seen = set(todo)
    while todo:
        module, name = todo.pop(0)
        functions, imports = _functions(tree(module)), _package_imports(tree(module), package)
        for used in sorted(_names_used(functions[name])):
            target = (module, used) if used in functions else imports.get(used)
            if target is None or target in seen or target[1] not in _functions(tree(target[0])):
                continue  # not a function of the package (a class, a constant, the library)
            seen.add(target)
            reached.append(target)
            todo.append(target)
    return reached


def schedule_path(family: str) -> Path:
    """The schedule file of ``family`` (:mod:`slapo_ae.sources` says where schedules live)."""
    return paths.ROOT / SCHEDULES / f"{family}.py"


def count_file(path: Path, for_pattern: re.Pattern = FOR_WORD):
    """``(lines, statements, function names, helpers)`` of the schedule file ``path``: its
    functions and the project helpers they call (:func:`called_helpers`), the helpers named
    ``"<module>.<function>"``."""
    lines, statements, names = count_source(path.read_text(), for_pattern)
    helpers = []
    for module, name in called_helpers(path):
        source = module.read_text()
        counted = _count_function(_functions(ast.parse(source))[name], source.splitlines(),
                                  for_pattern)
        lines, statements = lines + counted[0], statements + counted[1]
        helpers.append(f"{module.stem}.{name}")
    return lines, statements, names, tuple(helpers)


def count_loc(family: str, for_pattern: re.Pattern = FOR_WORD) -> LocCount:
    """Both counts for the schedule of ``family`` (see the module docstring)."""
    path = schedule_path(family)
    return LocCount(family, path.relative_to(paths.ROOT).as_posix(),
                    *count_file(path, for_pattern), PAPER_LOC.get(family))


def count_all() -> list[LocCount]:
    """``count_loc`` of every family, in the zoo's family order."""
    return [count_loc(family) for family in FAMILIES]


def main() -> None:
    print(f"{'family':<12} {'lines (artifact rule)':>22} {'statements':>11} {'paper':>6}  "
          "file and the helpers counted with it")
    for c in count_all():
        print(f"{c.family:<12} {c.lines:>22} {c.statements:>11} {c.paper or '-':>6}  {c.path}"
              + (f" + {', '.join(c.helpers)}" if c.helpers else ""))


if __name__ == "__main__":
    main()
