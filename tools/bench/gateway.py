#!/usr/bin/env python
"""Benchmark: the agent gateway's cost per step. The same arithmetic episodes (a correct two-step
script: the calculator, then the boxed answer) played by the built-in tool agent and, through the
gateway (a forked process per episode, HTTP), by the ``openai_agent`` recipe's SDK program (the
official ``openai`` client) and its plain-``urllib`` twin, against the same instant scripted
policy, so what differs is the agent's own machinery. All must record the same steps (checked)
before their times count.

    python tools/bench/gateway.py [--episodes 128] [--concurrency 32] [--repeat 3]

Ends with ``BENCH gateway_step_arithmetic ms_per_step=... baseline=builtin_agent ratio=...`` (the
SDK agent) and ``BENCH gateway_step_arithmetic_plain_http ...`` (the ratio: time per step over the
built-in agent's).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

from agent_r1.agent.chat import ChatCodec
from agent_r1.agent.flow import FlowConfig
from agent_r1.agent.run_episodes import run_episodes
from agent_r1.agent.tool_calls import format_tool_call
from agent_r1.rollout.protocol import Completion, FinishReason, SamplingParams
from recipes import load_recipe


def script_policy(codec: ChatCodec, rows):
    """Answers each prompt from its own question, instantly: the calculator, then the answer."""
    by_question = {r.prompt[-1]["content"]: r for r in rows}

    async def generate(ids, sampling, images=None):
        text = codec.decode(ids)
        row = next(r for q, r in by_question.items() if q in text)
        if "<tool_response>" in text:
            reply = f"The answer is \\boxed{{{row.reward_model['ground_truth']}}}."
        else:
            reply = format_tool_call("calculator", {"expression": row.extra_info["expression"]})
        out = codec.encode_action(reply)
        return Completion(out, [-0.1] * len(out), FinishReason.STOP, 1)

    return generate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--model", default=None, help="an HF folder whose tokenizer to use (default: a tiny one)")
    a = ap.parse_args()
    folder = a.model
    if folder is None:
        import subprocess
        import sys

        folder = str(Path(tempfile.mkdtemp()) / "tiny")
        subprocess.run([sys.executable, "tools/make_tiny_model.py", "--recipe", "arithmetic_tool", "--out", folder],
                       check=True, capture_output=True)  # fmt: skip
    codec = ChatCodec.load(folder)
    config = FlowConfig(max_steps=4, sampling=SamplingParams(max_new_tokens=256))
    timings: dict[str, float] = {}
    steps: dict[str, list] = {}
    agents = {"builtin_agent": ("arithmetic_tool", {}), "openai_sdk": ("openai_agent", {}),
              "plain_http": ("openai_agent", {"library": "http"})}  # fmt: skip
    for name, (recipe, options) in agents.items():
        rows = load_recipe(recipe).build_rows("test", a.episodes, seed=0, **options)
        policy = script_policy(codec, rows)

        async def play(rows=rows, policy=policy):
            return await run_episodes(
                rows, policy, codec, config, max_concurrency=a.concurrency, progress=False
            )

        asyncio.run(play())  # warm: the fork server imports the SDK once
        best = float("inf")
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            trajs = asyncio.run(play())
            best = min(best, time.perf_counter() - t0)
        n = sum(len(t.steps) for t in trajs)
        assert all(t.metrics["success"] == 1.0 for t in trajs), f"{name}: an episode failed"
        timings[name], steps[name] = best / n, [[s.obs_token_ids for s in t.steps] for t in trajs]
        print(
            f"{name}: {a.episodes} episodes, {n} steps, best of {a.repeat}: {best:.2f} s, {1e3 * best / n:.2f} ms/step"
        )
    for name in ("openai_sdk", "plain_http"):
        assert steps[name] == steps["builtin_agent"], (
            f"{name} recorded other observations than the built-in agent"
        )
    cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")), "?")
    print(f"cpu: {cpu} ({os.cpu_count()} cores); concurrency {a.concurrency}")
    base = 1e3 * timings["builtin_agent"]
    for name, bench in (
        ("openai_sdk", "gateway_step_arithmetic"),
        ("plain_http", "gateway_step_arithmetic_plain_http"),
    ):
        ms = 1e3 * timings[name]
        print(f"BENCH {bench} ms_per_step={ms:.2f} baseline=builtin_agent ratio={ms / base:.2f}")


if __name__ == "__main__":
    main()
