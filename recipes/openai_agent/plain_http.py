"""The same arithmetic agent with no SDK at all: the Chat Completions wire protocol over
``urllib`` (what an agent in any language does). It shows what the gateway takes and gives, and
prices the gateway alone (``tools/bench/gateway.py``: no SDK start-up in each episode's process)."""

from __future__ import annotations

import json
import os
import urllib.request

from recipes.openai_agent.agent import CALCULATOR, MAX_TURNS, run_tool


def chat(messages: list[dict]) -> dict:
    req = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        json.dumps({"model": "policy", "messages": messages, "tools": [CALCULATOR]}).encode(),
        {"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req) as r:
        return json.loads(r.read())["choices"][0]["message"]


def solve(task: dict) -> str:
    messages = list(task["prompt"])
    for _ in range(MAX_TURNS):
        msg = chat(messages)
        messages.append(msg)  # the reply as it came: the next call extends the conversation
        if not msg.get("tool_calls"):
            return msg.get("content") or ""
        for call in msg["tool_calls"]:
            result = run_tool(call["function"]["name"], call["function"]["arguments"])
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return ""
