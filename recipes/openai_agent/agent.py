"""An arithmetic agent written against the official ``openai`` Python SDK alone: function calling
and its own tool loop, no agent-r1 import. It is what a user brings: trained through the gateway,
it needs nothing but ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` (set per episode by the worker).

``solve(task)`` is called once per episode with the task (the row's ``prompt`` messages) and
returns the final answer text, which the recipe's reward function scores. Run by hand against any
OpenAI-compatible server: ``OPENAI_BASE_URL=http://HOST:PORT/v1 python -m
recipes.openai_agent.agent "Ann has 3 apples..."``.
"""

from __future__ import annotations

import ast
import json
import operator
import sys

from openai import OpenAI

SYSTEM = (
    "Solve the problem. Use the calculator tool for the arithmetic, then give the final answer as \\boxed{N}."
)
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / // % ** and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (12 + 7) * 3"}},
            "required": ["expression"],
            "additionalProperties": False,
        },
    },
}
MAX_TURNS = 8  # the gateway refuses calls past the episode's own limit first

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


def _value(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand)
    raise ValueError(f"unsupported syntax: {type(node).__name__}")


def calculate(expression: str) -> str:
    """The calculator this agent runs itself: + - * / // % and parentheses."""
    try:
        x = _value(ast.parse(expression.strip(), mode="eval").body)
    except ZeroDivisionError:
        return "Error: division by zero"
    except (SyntaxError, ValueError) as e:
        return f"Error: {e}"
    return str(int(x)) if isinstance(x, float) and x.is_integer() else str(x)


def run_tool(name: str, arguments: str) -> str:
    try:
        args = json.loads(arguments)
    except json.JSONDecodeError as e:
        return f"Error: arguments are not JSON ({e})"
    if name != "calculator" or not isinstance(args, dict) or not isinstance(args.get("expression"), str):
        return f"Error: unknown tool or arguments: {name}({arguments})"
    return calculate(args["expression"])


def solve(task: dict) -> str:
    client = OpenAI(max_retries=0)  # the base URL and key come from the environment
    messages = list(task["prompt"])
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
        msg = reply.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            return msg.content or ""
        for call in msg.tool_calls:
            result = run_tool(call.function.name, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return ""


if __name__ == "__main__":
    question = (
        " ".join(sys.argv[1:])
        or "Ava has 5 apples. Then Ava finds 7 more apples. How many apples does Ava have now?"
    )
    print(solve({"prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}))
