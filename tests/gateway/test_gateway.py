"""The agent gateway: an agent program's chat completions, made with the official ``openai`` SDK,
become step records token for token (checked against the built-in tool agent playing the same
script, and against a real ``agent-r1 serve``); rewrites, concurrency, limits, hung and crashing
programs, rewards the program reports, and the gateway's refusals."""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from eventually import eventually
from scripted import ScriptedPolicy, play

from agent_r1.agent.flow import AgentSpec, FlowConfig
from agent_r1.agent.run_episodes import run_episodes
from agent_r1.agent.tool_calls import format_tool_call
from agent_r1.agent_tools import TOOLS
from agent_r1.gateway.program_flow import ExternalAgentFlow
from agent_r1.rollout.protocol import SamplingParams
from recipes import load_recipe

openai = pytest.importorskip("openai")
load_recipe("arithmetic_tool")
load_recipe("openai_agent")
from recipes.arithmetic_tool import data as arithmetic  # noqa: E402
from recipes.openai_agent import agent as sdk_agent  # noqa: E402
from recipes.openai_agent import data as openai_agent  # noqa: E402


def script_for(row) -> list[str]:
    """A correct two-step solution: the calculator, then the boxed answer."""
    expr, answer = row.extra_info["expression"], row.reward_model["ground_truth"]
    return [format_tool_call("calculator", {"expression": expr}), f"The answer is \\boxed{{{answer}}}."]


def command_agent(source: str, **options) -> AgentSpec:
    """An agent program given as a command: ``python -c source``."""
    return AgentSpec(
        ExternalAgentFlow, {"command": [sys.executable, "-c", textwrap.dedent(source)], **options}
    )


def run_one(codec, spec: AgentSpec, row, script: list[str], **flow):
    policy = ScriptedPolicy(codec, script)
    config = FlowConfig(sampling=SamplingParams(max_new_tokens=256), **flow)
    return asyncio.run(spec.build(policy, codec, config).run(row, "t", "g")), policy


def test_the_sdk_agent_records_what_the_builtin_agent_records(codec):
    """The SDK agent (its own calculator and tool loop, through the gateway) and the built-in tool
    agent play the same script on the same problem: the same observations token for token (the
    second one extends the first: prefix-merged), the same actions and logprobs as the policy
    sampled them, the same rewards."""
    assert sdk_agent.CALCULATOR == TOOLS.get("calculator")().schema  # the same prompt as the built-in's
    ext_row = openai_agent.build_rows("test", 1, seed=3)[0]
    ref_row = arithmetic.build_rows("test", 1, seed=3)[0]
    assert ext_row.prompt == ref_row.prompt and ext_row.agent_name == "openai_agent"
    ext, ext_policy = play(codec, ext_row, script_for(ext_row), max_steps=4)
    ref, ref_policy = play(codec, ref_row, script_for(ref_row), max_steps=4)
    assert len(ext.steps) == len(ref.steps) == 2
    for a, b in zip(ext.steps, ref.steps, strict=True):
        assert a.obs_token_ids == b.obs_token_ids
        assert (a.action_token_ids, a.action_logprobs, a.action_mask) == (
            b.action_token_ids, b.action_logprobs, b.action_mask)  # fmt: skip
        assert (a.prefix_len, a.reward, a.done, a.truncated) == (b.prefix_len, b.reward, b.done, b.truncated)
        assert a.policy_version == 3 and a.feedback == b.feedback
    s0, s1 = ext.steps
    assert s1.prefix_len == len(s0.obs_token_ids) + len(s0.action_token_ids)  # merged into one sequence
    assert [c[0] for c in ext_policy.calls] == [s.obs_token_ids for s in ext.steps]  # what the policy saw
    assert ext.metrics["success"] == 1.0 and s1.reward == 1.0 and s1.info["reward"]["source"] == "answer"
    assert ext.metrics["num_tool_calls"] == ref.metrics["num_tool_calls"] == 1
    assert s0.info["rewrite"] is False and s1.info["rewrite"] is False


@pytest.mark.parametrize(
    ("library", "agent"), [("agents_sdk", "openai_agents_sdk"), ("http", "openai_plain_http")]
)
def test_other_agent_programs_record_what_the_builtin_agent_records(codec, library, agent):
    """The same episode played by the OpenAI Agents SDK's ``Runner`` (the library keeps the history
    and runs the tool loop), and by a program speaking the wire protocol over urllib: the same
    steps as the built-in agent, prefix-merged."""
    if library == "agents_sdk":
        pytest.importorskip("agents")
    ext_row = openai_agent.build_rows("test", 1, seed=3, library=library)[0]
    ref_row = arithmetic.build_rows("test", 1, seed=3)[0]
    assert ext_row.agent_name == agent
    ext, _ = play(codec, ext_row, script_for(ext_row), max_steps=4)
    ref, _ = play(codec, ref_row, script_for(ref_row), max_steps=4)
    assert [s.obs_token_ids for s in ext.steps] == [s.obs_token_ids for s in ref.steps]
    assert [(s.prefix_len, s.reward, s.info["rewrite"]) for s in ext.steps] == [
        (0, 0.0, False),
        (ref.steps[1].prefix_len, 1.0, False),
    ]
    assert ext.steps[1].info["reward"]["source"] == "answer"  # what Runner.run returned, scored


REWRITE = """
    import os, openai
    c = openai.OpenAI(max_retries=0)
    r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "first"}])
    # the history is rewritten: the reply is dropped, the question changed
    c.chat.completions.create(model="m", messages=[{"role": "user", "content": "second"}])
"""


def test_a_rewritten_history_is_a_new_prefix(codec):
    traj, policy = run_one(
        codec, command_agent(REWRITE), arithmetic.build_rows("test", 1)[0], ["a", "b"], max_steps=4
    )
    s0, s1 = traj.steps
    assert s1.info["rewrite"] is True
    assert s1.obs_token_ids == codec.encode_chat([{"role": "user", "content": "second"}])  # rendered afresh
    shared = codec.encode_chat([{"role": "user", "content": "first"}])
    assert 0 < s1.prefix_len < len(s0.obs_token_ids) == len(shared)  # only the system turn is shared
    assert s1.done and not s0.done and s0.reward == 0.0


STREAM = """
    import json, openai
    c = openai.OpenAI(max_retries=0)
    msgs = [{"role": "user", "content": "q"}]
    text = "".join(ch.choices[0].delta.content or "" for ch in
                   c.chat.completions.create(model="m", messages=msgs, stream=True))
    r = c.chat.completions.create(model="m", messages=msgs + [{"role": "assistant", "content": text},
                                  {"role": "user", "content": "again"}], logprobs=True)
    lps = [t.logprob for t in r.choices[0].logprobs.content]
    open(OUT, "w").write(json.dumps([text, lps, r.choices[0].finish_reason]))
"""


def test_a_streamed_reply_continues_the_conversation_and_logprobs_come_back(codec, tmp_path):
    out = tmp_path / "seen.json"
    src = f"OUT = {str(out)!r}\n" + textwrap.dedent(STREAM)
    traj, _ = run_one(codec, command_agent(src), arithmetic.build_rows("test", 1)[0], ["hello there", "x"])
    s0, s1 = traj.steps
    assert not s1.info["rewrite"] and s1.prefix_len == len(s0.obs_token_ids) + len(s0.action_token_ids)
    text, lps, finish = json.loads(out.read_text())
    assert text == "hello there" and lps == s1.action_logprobs and finish == "stop"


def test_32_concurrent_sessions_stay_apart(codec):
    """32 episodes of the SDK agent at once, one forked program each; the policy answers every
    prompt from its own question, so a step that landed in another session would show it."""
    rows = openai_agent.build_rows("test", 16, seed=5)

    async def policy(ids, sampling, images=None):
        from agent_r1.rollout.protocol import Completion, FinishReason

        text = codec.decode(ids)
        await asyncio.sleep(0.01 * (len(ids) % 7))  # interleave the sessions
        row = next(r for r in rows if r.prompt[-1]["content"] in text)
        reply = script_for(row)[0 if "<tool_response>" not in text else 1]
        out = codec.encode_action(reply)
        return Completion(out, [-0.5] * len(out), FinishReason.STOP, 1)

    config = FlowConfig(max_steps=4, sampling=SamplingParams(max_new_tokens=256))
    trajs = asyncio.run(run_episodes(rows, policy, codec, config, group_size=2, progress=False))
    assert len(trajs) == 32 and all(t.metrics["success"] == 1.0 for t in trajs)
    for t, row in zip(trajs, [r for r in rows for _ in range(2)], strict=True):
        assert len(t.steps) == 2 and {s.trajectory_id for s in t.steps} == {t.trajectory_id}
        assert row.prompt[-1]["content"] in codec.decode(t.steps[1].obs_token_ids)
        assert f"<tool_response>\n{row.reward_model['ground_truth']}\n</tool_response>" in codec.decode(
            t.steps[1].obs_token_ids
        )


def _left_behind(marker: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(marker in a for a in p.info["cmdline"] or []):
                out.append(p)
        except psutil.Error:
            pass
    return out


HANG = """
    import subprocess, time, openai
    subprocess.Popen(["sleep", "301.5"])  # a grandchild: must not outlive the episode
    openai.OpenAI(max_retries=0).chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}])
    time.sleep(1000)
"""
CRASH = """
    import openai
    openai.OpenAI(max_retries=0).chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}])
    raise RuntimeError("the agent broke")
"""


def test_a_hung_agent_ends_as_env_error_within_its_limit_and_leaves_nothing(codec):
    row = arithmetic.build_rows("test", 1)[0]
    t0 = time.monotonic()
    traj, _ = run_one(codec, command_agent(HANG, timeout_s=3), row, ["a"])
    assert time.monotonic() - t0 < 60  # the agent sleeps 1000 s: its 3 s limit ended it (named below)
    assert traj.metrics["env_error"] == 1.0 and "timeout_s=3" in traj.steps[-1].info["env_error"]
    assert eventually(lambda: _left_behind("301.5"), lambda left: left == []) == []


def test_a_hung_callable_is_stopped_with_what_it_started(codec, monkeypatch):
    """The same for a Python callable: its forked child and its grandchild are killed as a group
    (the zygote stays, for the next episode); a returned number is the reward."""
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[1] / "helpers"))
    row = arithmetic.build_rows("test", 1)[0]
    spec = AgentSpec(ExternalAgentFlow, {"callable": "gateway_agents:hang", "timeout_s": 3})
    traj, _ = run_one(codec, spec, row, ["a"])
    assert traj.metrics["env_error"] == 1.0 and len(traj.steps) == 1
    assert eventually(lambda: _left_behind("302.5"), lambda left: left == []) == []
    traj, _ = run_one(codec, AgentSpec(ExternalAgentFlow, {"callable": "gateway_agents:reward"}), row, ["a"])
    assert traj.steps[-1].reward == 0.25 and traj.metrics["success"] == 1.0


def test_a_crashing_agent_ends_as_env_error_with_its_error(codec):
    traj, _ = run_one(codec, command_agent(CRASH), arithmetic.build_rows("test", 1)[0], ["a"])
    last = traj.steps[-1]
    assert traj.metrics["env_error"] == 1.0 and last.done and last.reward == 0.0
    assert "status 1" in last.info["env_error"] and "RuntimeError: the agent broke" in last.info["env_error"]


def test_a_crashing_callable_and_a_missing_one(codec, tmp_path, monkeypatch):
    row = arithmetic.build_rows("test", 1)[0]
    bad = AgentSpec(ExternalAgentFlow, {"callable": "recipes.openai_agent.agent:no_such_function"})
    traj, _ = run_one(codec, bad, row, ["a"])
    assert traj.steps == [] and traj.metrics["env_error"] == 1.0
    with pytest.raises(ValueError, match="exactly one of command"):
        ExternalAgentFlow(None, codec, command=["x"], callable="m:f")


LOOP = """
    import openai
    c = openai.OpenAI(max_retries=0)
    msgs = [{"role": "user", "content": "q"}]
    while True:
        r = c.chat.completions.create(model="m", messages=msgs)
        msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "more"}]
"""


def test_the_step_limit_ends_the_episode_truncated_never_a_success(codec):
    row = arithmetic.build_rows("test", 1)[0]
    answer = f"\\boxed{{{row.reward_model['ground_truth']}}}"  # even a right answer is not scored
    traj, policy = run_one(codec, command_agent(LOOP), row, [answer] * 5, max_steps=2)
    assert len(traj.steps) == 2 and len(policy.calls) == 2
    last = traj.steps[-1]
    assert last.done and last.truncated and last.reward == 0.0 and last.info["truncated_by"] == "max_steps"
    assert "env_error" not in traj.metrics and not traj.metrics.get("success")


POST = """
    import json, os, urllib.request, openai
    openai.OpenAI(max_retries=0).chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}])
    req = urllib.request.Request(os.environ["AGENT_R1_REWARD_URL"], json.dumps({"reward": 0.75}).encode(),
                                 {"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
    urllib.request.urlopen(req).read()
"""
PRINT = """
    import openai
    openai.OpenAI(max_retries=0).chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}])
    print("agent-r1-reward: -0.5")
"""


@pytest.mark.parametrize(("source", "reward", "success"), [(POST, 0.75, 1.0), (PRINT, -0.5, 0.0)])
def test_the_program_reports_its_reward(codec, source, reward, success):
    traj, _ = run_one(codec, command_agent(source), arithmetic.build_rows("test", 1)[0], ["a"])
    last = traj.steps[-1]
    assert last.done and last.reward == reward and last.info["reward"]["source"] == "program"
    assert traj.metrics["success"] == success


REFUSALS = """
    import json, os, urllib.error, urllib.request
    base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
    def post(path, body, key=key, base=base):
        req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Authorization": "Bearer " + key})
        try:
            with urllib.request.urlopen(req) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())
    q = {"model": "m", "messages": [{"role": "user", "content": "q"}]}
    out = [post("/chat/completions", q, key="wrong"),
           post("/chat/completions", q, base=base.replace("/sessions/", "/sessions/x")),
           post("/chat/completions", {**q, "n": 2}), post("/chat/completions", {**q, "stop": ["x"]}),
           post("/chat/completions", {"model": "m", "messages": []}),
           post("/chat/completions", {**q, "tools": [{"type": "bogus"}]}),
           post("/chat/completions", {**q, "max_tokens": 0})]
    open(OUT, "w").write(json.dumps([[s, b["error"]["message"]] for s, b in out]))
"""


def test_the_gateway_refuses_bad_calls_clearly_and_records_nothing(codec, tmp_path):
    out = tmp_path / "refusals.json"
    src = f"OUT = {str(out)!r}\n" + textwrap.dedent(REFUSALS)
    traj, policy = run_one(codec, command_agent(src), arithmetic.build_rows("test", 1)[0], [])
    assert traj.steps == [] and policy.calls == [] and traj.metrics["no_steps"] == 1.0
    got = json.loads(out.read_text())
    assert [s for s, _ in got] == [401, 404, 400, 400, 400, 400, 400]
    says = ["API key", "no such session", "n:", "stop:", "messages:", "tools[0]", "max_tokens"]
    for (_, m), want in zip(got, says, strict=True):
        assert want in m


def test_through_a_real_server_the_records_hold_what_it_sampled(tool_model, tmp_path):
    """The SDK agent against a real ``agent-r1 serve`` (the tiny model taught one calculator call),
    through the run's rollout client: every step's action ids and logprobs are the server's own
    answer, and the second observation extends the first."""
    from rollout_servers import ServerProc
    from tool_model import ASK, CALL_TEXT

    from agent_r1.agent.chat import ChatCodec
    from agent_r1.rollout.client import RolloutClient

    codec = ChatCodec.load(str(tool_model))
    server = ServerProc(tool_model, tmp_path, "gw")
    sampled = []

    async def main():
        client = RolloutClient(servers=[server.url], timeout_s=60)

        async def generate(ids, sampling, images=None):
            out = await client(ids, sampling)
            sampled.append((list(ids), out))
            return out

        row = openai_agent.build_rows("test", 1)[0]
        row.prompt = list(ASK)
        config = FlowConfig(max_steps=2, max_action_tokens=48, sampling=SamplingParams(temperature=0.0))
        try:
            return await run_episodes([row], generate, codec, config, progress=False)
        finally:
            await client.close()

    try:
        (traj,) = asyncio.run(main())
    finally:
        server.kill()
    assert len(traj.steps) == len(sampled) == 2
    for step, (ids, out) in zip(traj.steps, sampled, strict=True):
        assert step.obs_token_ids == ids
        assert step.action_token_ids == out.token_ids and step.action_logprobs == out.logprobs
    s0, s1 = traj.steps
    assert codec.decode_action(s0.action_token_ids) == CALL_TEXT  # what the model was taught
    assert s1.obs_token_ids[: s1.prefix_len] == s0.obs_token_ids + s0.action_token_ids
    assert "<tool_response>\n84\n</tool_response>" in codec.decode(
        s1.obs_token_ids
    )  # the agent's own calculator
