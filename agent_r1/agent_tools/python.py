"""The ``python`` tool: the model's code runs in the sandbox (``sandbox``), and what it prints
comes back. Every failure (a syntax error, an exception, a limit) is an ``Error: ...`` observation
naming it, with what the code printed before it; the episode goes on.

Options (``tool_kwargs.python``): ``files`` (name -> text put in the run's scratch folder: a
task's table), ``pool`` (runs at once per worker), and the ``Limits`` (``wall_s``, ``cpu_s``,
``memory_mb``, ``file_mb``, ``processes``, ``output_chars``).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from agent_r1.agent_tools.base import TOOLS, BaseTool, ToolError, ToolOutput, string_arguments
from agent_r1.agent_tools.sandbox import Limits, Sandbox


@TOOLS.register("python")
class PythonTool(BaseTool):
    name = "python"
    description = "Run Python code (pandas as pd and numpy available) and see what it prints."
    parameters = string_arguments(closed=True, code="Python source; print() what you want to see")

    def __init__(self, files: dict[str, str] | None = None, pool: int = 4, **limits: Any):
        known = {f.name for f in fields(Limits)}
        unknown = sorted(set(limits) - known)
        if unknown:
            raise ValueError(
                f"tool python: no option {unknown[0]!r}; options: files, pool, {', '.join(sorted(known))}"
            )
        self.sandbox = Sandbox(Limits(**limits), pool)
        self.files = dict(files or {})
        self.timeout_s = self.sandbox.limits.wall_s + 10.0  # the sandbox's own wall limit comes first

    async def execute(self, args: dict[str, Any]) -> ToolOutput:
        r = await self.sandbox.run(args["code"], self.files)
        if r.error is not None:
            before = f"\n(printed before it: {r.stdout.strip()})" if r.stdout.strip() else ""
            raise ToolError(r.error + before)
        return ToolOutput(r.stdout.rstrip("\n") or "(no output: print() what you want to see)", None, {})
