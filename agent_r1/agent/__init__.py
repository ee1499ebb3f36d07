"""The agent layer: step-level MDP types, environments, tools, context management, flows."""

from agent_r1.agent.chat import ChatCodec
from agent_r1.agent.context import CONTEXTS, History, Turn, build_context
from agent_r1.agent.env import ENVS, AgentEnv, make_env
from agent_r1.agent.flow import AGENTS, AgentEnvLoop, AgentFlow, AgentSpec, FlowConfig, SingleStepFlow
from agent_r1.agent.tool_env import ToolEnv
from agent_r1.agent.types import (
    Action,
    Completion,
    FinishReason,
    GenerateFn,
    Observation,
    SamplingParams,
    StepResult,
)

__all__ = [
    "AGENTS",
    "CONTEXTS",
    "ENVS",
    "Action",
    "AgentEnv",
    "AgentEnvLoop",
    "AgentFlow",
    "AgentSpec",
    "ChatCodec",
    "Completion",
    "FinishReason",
    "FlowConfig",
    "GenerateFn",
    "History",
    "Observation",
    "SamplingParams",
    "SingleStepFlow",
    "StepResult",
    "ToolEnv",
    "Turn",
    "build_context",
    "make_env",
]
