"""``env_step``: one action in an interactive environment (a text game, a website), as a tool.

The environment that owns the tool binds itself (``tool.env = env``) and answers the call with
``await env.env_step(command) -> ToolOutput``, raising ``ToolError`` for an action it refuses.
Recipes register a subclass with their own description (the model sees it in the tool schema).
"""

from __future__ import annotations

from typing import Any, ClassVar

from agent_r1.agent_tools.base import BaseTool, ToolError, ToolOutput, string_arguments


class EnvStepTool(BaseTool):
    name = "env_step"
    example: ClassVar[str] = ""  # shown in the argument's description

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.env: Any = None  # bound by the environment that owns it

    @property
    def parameters(self) -> dict[str, Any]:  # type: ignore[override]
        return string_arguments(closed=True, command=self.example)

    async def execute(self, args: dict[str, Any]) -> ToolOutput:
        if self.env is None:
            raise ToolError(f"{self.name} works only inside its environment")
        return await self.env.env_step(args["command"])
