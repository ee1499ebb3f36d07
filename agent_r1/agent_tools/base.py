"""BaseTool: a JSON-schema described function the policy can call.

``execute(args)`` returns ``ToolOutput(result, reward, info)``. Tools report bad input by raising
``ToolError``; ``ToolEnv`` turns that (and any other exception, and timeouts) into error feedback
so a tool never crashes an episode.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import jsonschema

from agent_r1.agent_tools.services import NO_SERVICES, Services
from agent_r1.registry import Registry


class ToolError(Exception):
    """A tool's own, expected failure (bad argument value, no result)."""


@dataclass
class ToolOutput:
    result: str
    reward: float | None = None  # per-call process reward, None when the tool has no opinion
    info: dict[str, Any] = field(default_factory=dict)
    images: list[Any] = field(default_factory=list)  # ``Image``s shown after the result text


def string_arguments(closed: bool = False, **descriptions: str) -> dict[str, Any]:
    """The JSON schema of a tool whose arguments are required strings, each with its description
    (``closed``: no other argument is accepted)."""
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {k: {"type": "string", "description": d} for k, d in descriptions.items()},
        "required": list(descriptions),
    }
    if closed:
        schema["additionalProperties"] = False
    return schema


class BaseTool:
    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    parameters: ClassVar[dict[str, Any]] = {"type": "object", "properties": {}}
    timeout_s: float = 10.0
    # the services of the environment the tool runs in (its ToolEnv sets them): the retriever, ...
    services: Services = NO_SERVICES

    def __init__(self, **kwargs: Any):
        if kwargs:
            raise TypeError(f"tool {self.name!r} takes no options, got {sorted(kwargs)}")

    @property
    def schema(self) -> dict[str, Any]:
        """OpenAI/Hermes function schema, as shown to the model in the system prompt."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def validate(self, args: Any) -> None:
        """Raise ToolError naming the offending argument when ``args`` violates the schema."""
        if not isinstance(args, dict):
            raise ToolError(f"arguments must be a JSON object, got {type(args).__name__}")
        try:
            jsonschema.validate(args, self.parameters)
        except jsonschema.ValidationError as e:
            where = ".".join(str(p) for p in e.absolute_path) or "arguments"
            raise ToolError(f"invalid argument {where!r}: {e.message}") from None

    async def execute(self, args: dict[str, Any]) -> ToolOutput:
        raise NotImplementedError


TOOLS: Registry[type[BaseTool]] = Registry("tool")
