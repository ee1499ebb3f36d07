"""Tools an agent can call. Importing this package registers the built-in tools."""

from agent_r1.agent_tools import calculator, crop, python, search  # noqa: F401  (register their tools)
from agent_r1.agent_tools.base import TOOLS, BaseTool, ToolError, ToolOutput

__all__ = ["TOOLS", "BaseTool", "ToolError", "ToolOutput"]
