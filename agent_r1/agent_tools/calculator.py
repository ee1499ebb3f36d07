"""A safe arithmetic evaluator: an AST whitelist, no eval, no sympify, bounded sizes.

Allowed: numbers, + - * / // % **, unary +/-, parentheses. Powers and results are bounded so
``9**9**9`` fails fast instead of eating the machine.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any

from agent_r1.agent_tools.base import TOOLS, BaseTool, ToolError, ToolOutput, string_arguments

MAX_EXPR_CHARS = 300
MAX_NODES = 200
MAX_INT_BITS = 512  # ~1e154
MAX_ABS_FLOAT = 1e154
MAX_EXPONENT = 1024

_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_SYMBOLS = {"×": "*", "÷": "/", "−": "-", "–": "-"}


def _check_size(x: int | float) -> int | float:
    if isinstance(x, int):
        if x.bit_length() > MAX_INT_BITS:
            raise ToolError("result too large")
    elif not math.isfinite(x) or abs(x) > MAX_ABS_FLOAT:
        raise ToolError("result too large or not finite")
    return x


def _pow(a: int | float, b: int | float) -> int | float:
    if abs(b) > MAX_EXPONENT:
        raise ToolError(f"exponent {b} too large (max {MAX_EXPONENT})")
    if a != 0 and abs(a) != 1 and isinstance(b, (int, float)) and b > 0:
        # bits of the result ~ b * log2|a|: refuse before computing
        if b * math.log2(abs(a)) > MAX_INT_BITS:
            raise ToolError("result too large")
    if a == 0 and b < 0:
        raise ToolError("division by zero")
    r = a**b
    if isinstance(r, complex):
        raise ToolError("complex result (negative base with fractional exponent)")
    return r


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _check_size(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        a, b = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            return _check_size(_pow(a, b))
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and b == 0:
            raise ToolError("division by zero")
        return _check_size(_BINOPS[type(node.op)](a, b))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        raise ToolError("'^' is not a power here; use '**'")
    raise ToolError(f"unsupported syntax: {type(node).__name__}")


def format_number(x: int | float) -> str:
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e15:
        return str(int(x))
    if isinstance(x, float):
        return f"{x:.10g}"
    return str(x)


def evaluate(expression: str) -> int | float:
    """Evaluate an arithmetic expression safely; raises ToolError with a readable reason."""
    if not isinstance(expression, str) or not expression.strip():
        raise ToolError("empty expression")
    if len(expression) > MAX_EXPR_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPR_CHARS} characters")
    for k, v in _SYMBOLS.items():
        expression = expression.replace(k, v)
    expression = expression.replace(",", "") if _looks_like_thousands(expression) else expression
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ToolError(f"syntax error: {e.msg}") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise ToolError(f"expression has more than {MAX_NODES} parts")
    return _eval(tree)


def _looks_like_thousands(expr: str) -> bool:
    # "1,234 + 5" -> thousands separators; anything else with a comma is left to fail parsing
    import re

    return bool(re.fullmatch(r"[\d\s+\-*/().%]*(\d{1,3}(,\d{3})+)[\d\s+\-*/().%,]*", expr))


@TOOLS.register("calculator")
class Calculator(BaseTool):
    name = "calculator"
    description = "Evaluate an arithmetic expression with + - * / // % ** and parentheses."
    parameters = string_arguments(closed=True, expression="e.g. (12 + 7) * 3")
    timeout_s = 2.0

    async def execute(self, args: dict[str, Any]) -> ToolOutput:
        value = evaluate(args["expression"])
        return ToolOutput(format_number(value), None, {"value": float(value)})
