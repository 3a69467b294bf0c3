"""The safe batch-size expression evaluator (slapo_ae.expr)."""
import ast
import builtins

import pytest

from slapo_ae.expr import ExpressionError, batch_size, evaluate, parse


@pytest.fixture
def no_exec(monkeypatch, tmp_path):
    """Run in an empty folder and fail the test if anything evaluates code: eval/exec are
    replaced, and compile may only build an AST (which is what ast.parse does)."""
    monkeypatch.chdir(tmp_path)
    real_compile = builtins.compile

    def guarded_compile(source, filename, mode, flags=0, *args, **kwargs):
        assert flags & ast.PyCF_ONLY_AST, "compile() to code object"
        return real_compile(source, filename, mode, flags, *args, **kwargs)

    def forbidden(*args, **kwargs):
        raise AssertionError("eval/exec called")

    monkeypatch.setattr(builtins, "compile", guarded_compile)
    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    return tmp_path


# The paper's examples (its cfg files), worked out by hand for n = 1, 2, 4, 8.
PAPER_EXAMPLES = {
    "16*n": [16, 32, 64, 128],
    "min(8*n, 48)": [8, 16, 32, 48],  # 8*8 = 64 > 48
    "16 if n<=2 else 10*n": [16, 16, 40, 80],
    "8 * int(math.log2(n) + 1)": [8, 16, 24, 32],  # log2: 0, 1, 2, 3
}


@pytest.mark.parametrize("text", PAPER_EXAMPLES)
def test_paper_examples(text, no_exec):
    assert [batch_size(text, n) for n in (1, 2, 4, 8)] == PAPER_EXAMPLES[text]


@pytest.mark.parametrize(
    "text, n, value",
    [
        ("n // 3 + n % 3", 8, 4),
        ("2 ** 10", 1, 1024),
        ("-n + 10", 2, 8),
        ("1 < n <= 4", 4, True),
        ("1 < n <= 4", 8, False),
        ("n == 2 or n == 8", 8, True),
        ("not n > 2 and n != 1", 2, True),
        ("max(n, 3, 2)", 1, 3),
        ("abs(-n)", 4, 4),
        ("round(n / 3)", 8, 3),
        ("n / 2", 4, 2.0),
        ("2 if n==2 else 5 if n==4 else 10", 4, 5),
        ("(n > 2) * 8", 4, 8),
    ],
)
def test_operators(text, n, value, no_exec):
    assert evaluate(text, n) == value


def test_int_valued_float_is_a_batch_size():
    assert batch_size("n / 2", 4) == 2
    assert isinstance(batch_size("n / 2", 4), int)


@pytest.mark.parametrize("text", ["n / 3", "0 * n", "n - 10", "n > 1", "1.5"])
def test_batch_must_be_positive_integer(text):
    with pytest.raises(ExpressionError):
        batch_size(text, 2)


@pytest.mark.parametrize(
    "text, says",
    [
        ("__import__('os')", "__import__"),
        ("__import__('os').system('touch pwned')", "a call to"),
        ("().__class__", "attribute access '.__class__'"),
        ("n.__class__", "attribute access '.__class__'"),
        ("open('x')", "'open'"),
        ("9**9**9", "exponent"),
        ("10**10**10", "exponent"),
        ("10**100", "exponent"),
        ("2**63", "exceeds"),
        ("10**6 * 10**6 * 10", "exceeds"),
        ("1e300", "exceeds"),
        ("lambda: 1", "lambda"),
        ("[1][0]", "subscript"),
        ("[x for x in (1,)]", "list comprehension"),
        ("m * 2", "the name 'm'"),
        ("math", "the name 'math'"),
        ("math.sqrt(n)", "'math.sqrt'"),
        ("math.log2", "attribute access '.log2'"),
        ("os.system", "attribute access"),
        ("'16'", "str constant"),
        ("True", "bool constant"),
        ("min(*[n, 2])", "starred"),
        ("int('7', base=8)", "keyword argument 'base'"),
        ("round(5, -10**11)", "round() takes 1"),
        ("min(n)", "min() takes 2 or more"),
        ("(y := 3)", "assignment expression"),
        ("n; import os", "syntax error"),
        ("n +", "syntax error"),
        ("f'{n}'", "f-string"),
        ("n @ n", "MatMult"),
        ("n << 40", "LShift"),
        ("1 in (1, 2)", "In"),
        ("~n", "Invert"),
    ],
)
def test_hostile_and_bad_expressions_are_refused(text, says, no_exec):
    with pytest.raises(ExpressionError) as err:
        evaluate(text, 2)
    assert says in str(err.value)
    assert not list(no_exec.iterdir()), "something ran"


@pytest.mark.parametrize("text", ["n / 0", "n // 0", "n % 0", "math.log2(0)", "math.log2(n - 4)",
                                  "0 ** -1", "(-8) ** 0.5"])
def test_arithmetic_errors_become_expression_errors(text):
    with pytest.raises(ExpressionError):
        evaluate(text, 2)


def test_expression_error_is_value_error():
    assert issubclass(ExpressionError, ValueError)


def test_deep_nesting_and_length_are_refused():
    assert evaluate("-" * 498 + "n", 2) == 2  # long but harmless
    with pytest.raises(ExpressionError, match="nested"):
        parse("(" * 240 + "n" + ")" * 240)
    with pytest.raises(ExpressionError, match="longer than"):
        parse("+".join(["n"] * 400))


def test_short_circuit_skips_the_bad_branch():
    # the refused construct is caught at parse time even in a branch never taken
    with pytest.raises(ExpressionError):
        evaluate("n if n > 0 else __import__('os')", 2)
    # but a runtime error in an untaken branch does not happen
    assert evaluate("8 if n > 0 else 1 / 0", 2) == 8
