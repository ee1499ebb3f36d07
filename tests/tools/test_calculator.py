import asyncio
import time
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent_r1.agent_tools import TOOLS, ToolError
from agent_r1.agent_tools.calculator import evaluate, format_number


@pytest.mark.parametrize(
    "expr,value",
    [
        ("1+2*3", 7),
        ("(1+2)*3", 9),
        ("7/2", 3.5),
        ("7//2", 3),
        ("7%3", 1),
        ("2**10", 1024),
        ("-3+ +4", 1),
        ("1,234 + 1", 1235),
        ("6 × 7", 42),
        ("8 ÷ 2", 4),
        ("2.5*4", 10.0),
        ("(-8)**2", 64),
    ],
)
def test_values(expr, value):
    assert evaluate(expr) == value


@pytest.mark.parametrize(
    "expr,msg",
    [
        ("__import__('os').system('true')", "unsupported"),
        ("().__class__", "unsupported"),
        ("x + 1", "unsupported"),
        ("abs(-1)", "unsupported"),
        ("lambda: 1", "unsupported"),
        ("[1, 2]", "unsupported"),
        ("'a' * 3", "unsupported"),
        ("1 if 1 else 2", "unsupported"),
        ("2 ^ 3", "use"),
        ("1/0", "division by zero"),
        ("1 % 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("(-8) ** 0.5", "complex"),
        ("1 +", "syntax error"),
        ("", "empty"),
        ("1" * 400, "longer than"),
        ("+".join(["1"] * 150), "more than"),
        ("10.0 ** 400", "too large"),
        ("1e308 * 10", "too large"),
    ],
)
def test_rejects(expr, msg):
    with pytest.raises(ToolError, match=msg):
        evaluate(expr)


@pytest.mark.parametrize("expr", ["9**9**9", "2**100000", "99999**999 * 99999**999", "(10**150)*(10**150)"])
def test_huge_is_refused_fast(expr):
    t0 = time.perf_counter()
    with pytest.raises(ToolError, match="too large"):
        evaluate(expr)
    assert time.perf_counter() - t0 < 0.5


def test_format_number():
    assert (
        format_number(8.0) == "8" and format_number(3.5) == "3.5" and format_number(1 / 3) == "0.3333333333"
    )


def _exprs():
    leaf = st.integers(0, 999).map(str)
    return st.recursive(
        leaf,
        lambda c: st.tuples(c, st.sampled_from(["+", "-", "*", "/"]), c).map(
            lambda t: f"({t[0]} {t[1]} {t[2]})"
        ),
        max_leaves=8,
    )


def _exact(expr: str) -> Fraction:
    """An independent evaluator on Fractions (recursive descent over the fully parenthesised form)."""
    tokens = expr.replace("(", " ( ").replace(")", " ) ").split()

    def parse(i):
        if tokens[i] == "(":
            a, i = parse(i + 1)
            op = tokens[i]
            b, i = parse(i + 1)
            assert tokens[i] == ")"
            if op == "/" and b == 0:
                raise ZeroDivisionError
            return {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else None}[op], i + 1
        return Fraction(int(tokens[i])), i + 1

    return parse(0)[0]


@settings(max_examples=300, deadline=None)
@given(_exprs())
def test_matches_exact_arithmetic(expr):
    try:
        ref = _exact(expr)
    except ZeroDivisionError:
        with pytest.raises(ToolError, match="division by zero"):
            evaluate(expr)
        return
    got = evaluate(expr)
    assert abs(Fraction(got) - ref) <= abs(ref) * Fraction(1, 10**9) + Fraction(1, 10**9)


def test_tool_schema_and_execute():
    calc = TOOLS.get("calculator")()
    assert calc.schema["function"]["name"] == "calculator"
    out = asyncio.run(calc.execute({"expression": "6*7"}))
    assert out.result == "42" and out.reward is None
    with pytest.raises(ToolError, match="expression"):
        calc.validate({"expression": 42})
    with pytest.raises(ToolError, match="required|expression"):
        calc.validate({})
    with pytest.raises(ToolError, match="Additional|additional"):
        calc.validate({"expression": "1", "x": 2})
