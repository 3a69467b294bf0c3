"""A safe evaluator for batch-size expressions in the GPU count ``n``.

The cfg files give the global batch as an expression of ``n`` (docs/harness.md), for example
``16*n``, ``min(8*n, 48)``, ``16 if n<=2 else 10*n`` or ``8 * int(math.log2(n) + 1)``.
The text is parsed with :func:`ast.parse` and walked against an allow-list; nothing is ever
compiled or executed. Allowed:

- int and float constants, the name ``n`` (:func:`evaluate_in`: the names it is given, as a
  tuning's constraints name its symbols);
- ``+ - * / // % **`` (``**``: exponent at most ``MAX_EXPONENT`` in magnitude), unary ``-``/``+``;
- comparisons ``< <= > >= == !=`` (chained), ``and``, ``or``, ``not``, ``a if c else b``;
- calls with positional arguments to ``min``, ``max``, ``int``, ``round``, ``abs`` and
  ``math.log2`` (the only attribute access allowed).

Every intermediate number must stay within ``MAX_MAGNITUDE`` in magnitude; a power is refused
*before* it is computed when its result would not, so ``10**10**10`` costs nothing.
Anything else raises :class:`ExpressionError` naming the construct.
"""
from __future__ import annotations

import ast
import math
import operator

MAX_MAGNITUDE = 1e12
MAX_EXPONENT = 64
MAX_LENGTH = 500

_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_CMPOPS = {
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
}
# name -> (function, min args, max args)
_FUNCS = {
    "min": (min, 2, None),
    "max": (max, 2, None),
    "int": (int, 1, 1),
    "round": (round, 1, 1),  # no ndigits: round(5, -10**11) would build a huge power
    "abs": (abs, 1, 1),
    "math.log2": (math.log2, 1, 1),
}
ALLOWED = "numbers, n, + - * / // % **, comparisons, and/or/not, 'a if c else b', " + ", ".join(
    f"{f}()" for f in _FUNCS
)


class ExpressionError(ValueError):
    """A batch-size expression that is malformed, not allowed, or evaluates badly."""


def _describe(node: ast.AST) -> str:
    """A short human name for a refused construct."""
    if isinstance(node, ast.Name):
        return f"the name {node.id!r}"
    if isinstance(node, ast.Attribute):
        return f"attribute access '.{node.attr}'"
    if isinstance(node, ast.Constant):
        return f"the {type(node.value).__name__} constant {node.value!r}"
    if isinstance(node, ast.Call):
        try:
            return f"a call to {ast.unparse(node.func)!r}"
        except Exception:  # pragma: no cover - unparse of odd nodes
            return "a call"
    names = {
        ast.Subscript: "subscript", ast.Lambda: "lambda", ast.ListComp: "list comprehension",
        ast.SetComp: "set comprehension", ast.DictComp: "dict comprehension",
        ast.GeneratorExp: "generator expression", ast.Starred: "starred argument",
        ast.JoinedStr: "f-string", ast.NamedExpr: "assignment expression ':='",
        ast.List: "list", ast.Tuple: "tuple", ast.Dict: "dict", ast.Set: "set",
    }
    for cls, name in names.items():
        if isinstance(node, cls):
            return name
    if isinstance(node, (ast.operator, ast.unaryop, ast.cmpop)):
        return f"the operator {type(node).__name__}"
    return f"{type(node).__name__} expression"


def _refuse(node: ast.AST, text: str, names=("n",)) -> ExpressionError:
    allowed = ALLOWED if tuple(names) == ("n",) else ALLOWED.replace(
        "numbers, n,", f"numbers, the names {', '.join(names)},")
    return ExpressionError(f"{text!r}: {_describe(node)} is not allowed (allowed: {allowed})")


def _func_name(func: ast.AST) -> str | None:
    if isinstance(func, ast.Name) and func.id in _FUNCS and "." not in func.id:
        return func.id
    if (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
            and func.value.id == "math" and func.attr == "log2"):
        return "math.log2"
    return None


def _check(node: ast.AST, text: str, names=("n",)) -> None:
    """Walk the tree and refuse any node outside the allow-list (no evaluation)."""
    if isinstance(node, ast.Expression):
        return _check(node.body, text, names)
    if isinstance(node, ast.Constant):
        if type(node.value) not in (int, float):
            raise _refuse(node, text)
        return
    if isinstance(node, ast.Name):
        if node.id not in names:
            raise _refuse(node, text, names)
        return
    if isinstance(node, ast.BinOp):
        if type(node.op) not in _BINOPS:
            raise _refuse(node.op, text)
        children = [node.left, node.right]
    elif isinstance(node, ast.UnaryOp):
        if not isinstance(node.op, (ast.USub, ast.UAdd, ast.Not)):
            raise _refuse(node.op, text)
        children = [node.operand]
    elif isinstance(node, ast.Compare):
        for op in node.ops:
            if type(op) not in _CMPOPS:
                raise _refuse(op, text)
        children = [node.left, *node.comparators]
    elif isinstance(node, ast.BoolOp):
        children = node.values
    elif isinstance(node, ast.IfExp):
        children = [node.test, node.body, node.orelse]
    elif isinstance(node, ast.Call):
        name = _func_name(node.func)
        if name is None:
            raise _refuse(node, text)
        if node.keywords:
            raise ExpressionError(
                f"{text!r}: keyword argument {node.keywords[0].arg!r}= in {name}() is not allowed"
            )
        for arg in node.args:
            if isinstance(arg, ast.Starred):
                raise _refuse(arg, text)
        _, lo, hi = _FUNCS[name]
        if len(node.args) < lo or (hi is not None and len(node.args) > hi):
            want = f"{lo}" if lo == hi else f"{lo} or more" if hi is None else f"{lo} to {hi}"
            raise ExpressionError(
                f"{text!r}: {name}() takes {want} arguments, got {len(node.args)}")
        children = node.args
    else:
        raise _refuse(node, text)
    for child in children:
        _check(child, text, names)


def parse(text: str, names=("n",)) -> ast.Expression:
    """Parse and check ``text`` (whose only names may be ``names``); return its tree. Raises
    :class:`ExpressionError`."""
    if not isinstance(text, str):
        raise ExpressionError(f"expression must be a string, got {type(text).__name__}")
    if len(text) > MAX_LENGTH:
        raise ExpressionError(f"expression longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as err:
        raise ExpressionError(f"{text!r}: syntax error: {err.msg}") from None
    except (RecursionError, MemoryError, ValueError):
        raise ExpressionError(f"{text!r}: cannot be parsed (too deeply nested?)") from None
    try:
        _check(tree, text, tuple(names))
    except RecursionError:
        raise ExpressionError(f"{text!r}: too deeply nested") from None
    return tree


def _bounded(value, text: str):
    if isinstance(value, bool):
        return value
    if isinstance(value, float) and math.isnan(value):
        raise ExpressionError(f"{text!r}: result is not a number")
    if abs(value) > MAX_MAGNITUDE:
        raise ExpressionError(f"{text!r}: intermediate value exceeds {MAX_MAGNITUDE:g}")
    return value


def _power(base, exp, text: str):
    if abs(exp) > MAX_EXPONENT:
        raise ExpressionError(f"{text!r}: exponent {exp!r} exceeds {MAX_EXPONENT}")
    if abs(base) > 1 and exp > 0 and exp * math.log10(abs(base)) > math.log10(MAX_MAGNITUDE):
        raise ExpressionError(f"{text!r}: {base!r}**{exp!r} exceeds {MAX_MAGNITUDE:g}")
    result = base**exp
    if isinstance(result, complex):
        raise ExpressionError(f"{text!r}: {base!r}**{exp!r} is not a real number")
    return result


def _eval(node: ast.AST, env: dict, text: str):
    if isinstance(node, ast.Expression):
        return _eval(node.body, env, text)
    if isinstance(node, ast.Constant):
        return _bounded(node.value, text)
    if isinstance(node, ast.Name):
        return env[node.id]
    if isinstance(node, ast.BinOp):
        left, right = _eval(node.left, env, text), _eval(node.right, env, text)
        if isinstance(node.op, ast.Pow):
            return _bounded(_power(left, right, text), text)
        return _bounded(_BINOPS[type(node.op)](left, right), text)
    if isinstance(node, ast.UnaryOp):
        value = _eval(node.operand, env, text)
        if isinstance(node.op, ast.Not):
            return not value
        return -value if isinstance(node.op, ast.USub) else +value
    if isinstance(node, ast.Compare):
        left = _eval(node.left, env, text)
        for op, comp in zip(node.ops, node.comparators):
            right = _eval(comp, env, text)
            if not _CMPOPS[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.BoolOp):
        is_and = isinstance(node.op, ast.And)
        value = None
        for sub in node.values:
            value = _eval(sub, env, text)
            if bool(value) != is_and:  # short-circuit like Python
                return value
        return value
    if isinstance(node, ast.IfExp):
        return _eval(node.body if _eval(node.test, env, text) else node.orelse, env, text)
    if isinstance(node, ast.Call):
        func = _FUNCS[_func_name(node.func)][0]
        return _bounded(func(*(_eval(a, env, text) for a in node.args)), text)
    raise _refuse(node, text)  # unreachable after _check


def evaluate(text: str, n: int | float):
    """Evaluate the expression ``text`` with ``n`` bound to the GPU count; return a number."""
    return evaluate_in(text, {"n": n})


def evaluate_in(text: str, env: dict):
    """Evaluate ``text`` with the names of ``env`` bound to their numbers (for example a
    tuning's constraint ``batch_size % n == 0`` with ``{"batch_size": 48, "n": 2}``); any
    other name is refused. Returns a number or a bool."""
    tree = parse(text, tuple(env))
    try:
        return _eval(tree, env, text)
    except ExpressionError:
        raise
    except (ArithmeticError, TypeError, ValueError) as err:
        bound = ", ".join(f"{k}={v!r}" for k, v in env.items())
        raise ExpressionError(f"{text!r} with {bound}: {type(err).__name__}: {err}") from None


def batch_size(text: str, n: int) -> int:
    """The global batch for ``n`` GPUs: a positive integer (an int-valued float is accepted)."""
    value = evaluate(text, n)
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ExpressionError(f"{text!r} with n={n} gives {value!r}, not an integer batch size")
    if value < 1:
        raise ExpressionError(f"{text!r} with n={n} gives {value!r}, not a positive batch size")
    return int(value)
