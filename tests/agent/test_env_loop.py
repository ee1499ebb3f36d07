import asyncio
from typing import Any

import pytest
from scripted import ScriptedPolicy

from agent_r1.agent.context import Turn
from agent_r1.agent.env import ENVS
from agent_r1.agent.flow import AGENTS, AgentEnvLoop, FlowConfig, SingleStepFlow
from agent_r1.agent.tool_calls import format_tool_call
from agent_r1.agent.tool_env import ToolEnv
from agent_r1.agent.types import Observation, SamplingParams, StepResult
from agent_r1.agent_tools import TOOLS, BaseTool, ToolOutput
from agent_r1.data.rows import DataRow


class Sleepy(BaseTool):
    name = "sleepy"
    parameters = {"type": "object", "properties": {}}
    timeout_s = 0.05

    async def execute(self, args):
        await asyncio.sleep(5)
        return ToolOutput("late")


class Boom(BaseTool):
    name = "boom"
    parameters = {"type": "object", "properties": {}}

    async def execute(self, args):
        raise RuntimeError("kaput")


class Rewarder(BaseTool):
    name = "rewarder"
    parameters = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}

    async def execute(self, args):
        return ToolOutput(f"ok {args['n']}", 0.5, {"n": args["n"]})


for cls in (Sleepy, Boom, Rewarder):
    if cls.name not in TOOLS:
        TOOLS.register(cls.name)(cls)


def _row(env_kwargs=None, truth="7", question="Ava has 3 apples and finds 4. How many?"):
    return DataRow(
        prompt=[{"role": "user", "content": question}],
        agent_name="tool_agent",
        reward_model={"style": "math_number", "ground_truth": truth},
        data_source="test",
        env_kwargs={"tools": ["calculator", "sleepy", "boom", "rewarder"], **(env_kwargs or {})},
    )


def _run(codec, responses, row=None, config=None, **flow_kw):
    policy = ScriptedPolicy(codec, responses)
    flow = AgentEnvLoop(policy, codec, config or FlowConfig(max_steps=8, max_action_tokens=200), **flow_kw)
    return flow, policy, asyncio.run(flow.run(row or _row(), "t0", "g0"))


CALC = format_tool_call("calculator", {"expression": "3+4"})


def test_tool_then_answer_append_mode(codec):
    _, policy, traj = _run(codec, [f"I will compute. {CALC}", "The answer is \\boxed{7}."])
    s0, s1 = traj.steps
    # the tool result reached the next observation, as a user turn
    assert "<tool_response>\n7\n</tool_response>" in codec.decode(s1.obs_token_ids)
    assert s0.feedback == "<tool_response>\n7\n</tool_response>"
    # append mode: the next observation extends obs + action exactly (token ids as sampled)
    assert (
        s1.obs_token_ids[: len(s0.obs_token_ids) + len(s0.action_token_ids)]
        == s0.obs_token_ids + s0.action_token_ids
    )
    assert s1.prefix_len == len(s0.obs_token_ids) + len(s0.action_token_ids)
    assert s0.prefix_len == 0
    # obs ids are exactly what was sent to the policy
    assert [c[0] for c in policy.calls] == [s0.obs_token_ids, s1.obs_token_ids]
    assert s0.action_logprobs == [-0.01 * (i + 1) for i in range(len(s0.action_token_ids))]
    assert s0.action_mask == [1] * len(s0.action_token_ids) and s0.policy_version == 3
    assert (s0.reward, s0.done, s0.process_reward) == (0.0, False, [None])
    assert s1.done and not s1.truncated and s1.reward == 1.0 and traj.metrics["success"] == 1.0
    assert traj.num_tool_calls == 1 and s0.info["tool_calls"][0]["value"] == 7.0


def test_wrong_answer_gets_format_score_and_no_answer_zero(codec):
    _, _, traj = _run(codec, ["\\boxed{8}"])
    assert traj.steps[0].reward == pytest.approx(0.1) and traj.metrics["success"] == 0.0
    _, _, traj = _run(codec, ["I don't know"])
    assert traj.steps[0].reward == 0.0


@pytest.mark.parametrize(
    "call,error",
    [
        ('<tool_call>{"name": "calculator", "arguments": {"expression": "3+4"}</tool_call>', "invalid JSON"),
        (format_tool_call("nope", {}), "unknown tool 'nope'"),
        (format_tool_call("calculator", {"expression": 34}), "invalid argument 'expression'"),
        (format_tool_call("calculator", {"expression": "9**9**9"}), "too large"),
        (format_tool_call("boom", {}), "boom raised RuntimeError: kaput"),
        (format_tool_call("sleepy", {}), "sleepy: timed out after 0.05 s"),
    ],
)
def test_bad_calls_become_error_feedback(codec, call, error):
    row = _row({"error_penalty": 0.25})
    _, _, traj = _run(codec, [call, "\\boxed{7}"], row=row)
    s0 = traj.steps[0]
    assert error in s0.feedback and s0.feedback.startswith("<tool_response>\nError: ")
    assert error in codec.decode(traj.steps[1].obs_token_ids)  # the model sees the error
    assert s0.process_reward == [-0.25] and s0.info["num_tool_errors"] == 1
    assert traj.steps[1].reward == 1.0  # the episode went on


def test_several_calls_run_concurrently_in_order(codec):
    calls = format_tool_call("sleepy", {}) + format_tool_call("rewarder", {"n": 2}) + CALC
    _, _, traj = _run(codec, [calls, "\\boxed{7}"])
    s0 = traj.steps[0]
    assert s0.process_reward == [None, 0.5, None]
    results = s0.feedback.split("</tool_response>")
    assert "timed out" in results[0] and "ok 2" in results[1] and "\n7\n" in results[2]


def test_too_many_calls_are_refused(codec):
    calls = CALC * 3
    _, _, traj = _run(codec, [calls, "\\boxed{7}"], row=_row({"max_calls_per_step": 2}))
    assert "too many tool calls" in traj.steps[0].feedback and len(traj.steps[0].process_reward) == 3


def test_max_steps_ends_truncated(codec):
    _, _, traj = _run(codec, [CALC] * 3, row=_row({"max_steps": 3}))
    assert len(traj.steps) == 3 and traj.steps[-1].done and traj.steps[-1].truncated
    assert traj.steps[-1].reward == 0.0  # scored: no answer given
    # the flow's own cap works too
    _, _, traj = _run(codec, [CALC] * 2, config=FlowConfig(max_steps=2, max_action_tokens=200))
    assert len(traj.steps) == 2 and traj.steps[-1].truncated and traj.steps[-1].done


def test_action_budget_and_truncated_action(codec):
    _, policy, traj = _run(
        codec, [CALC + " more words to exceed the budget"], config=FlowConfig(max_action_tokens=5)
    )
    assert policy.calls[0][1].max_new_tokens == 5
    (s,) = traj.steps
    assert len(s.action_token_ids) == 5 and s.finish_reason == "length" and s.done and s.truncated


@ENVS.register("test_env_ends_only")
class EnvEndsOnly(ToolEnv):
    """Only the environment ends episodes (as WebShop and ALFWorld): a reply without a call is an error."""

    def answer_allowed(self) -> bool:
        return False


@pytest.mark.parametrize("env, penalty, flow_steps, reward", [
    ("test_env_ends_only", 0.1, 8, -0.8),  # where only the env ends episodes: an invalid call per step left
    ("test_env_ends_only", 0.1, 3, -0.3),  # ... counted to the flow's limit when it comes before the env's 8
    ("test_env_ends_only", 0.1, 20, -0.8),  # ... and to the env's 8 when the flow allows more
    ("test_env_ends_only", 0.0, 8, 0.0),  # no penalty set: scored like any unanswered episode
    ("tool", 0.1, 8, 0.0),  # answers allowed: the cut reply is scored as the answer
])  # fmt: skip
def test_a_cut_action_ends_the_episode_and_costs_an_invalid_call_per_step_left(
    codec, env, penalty, flow_steps, reward
):
    policy = ScriptedPolicy(codec, [CALC + " more words to exceed the budget", CALC])
    flow = AgentEnvLoop(policy, codec, FlowConfig(max_steps=flow_steps, max_action_tokens=5), env=env)
    traj = asyncio.run(flow.run(_row({"error_penalty": penalty}), "t", "g"))  # the env's max_steps: 8
    (s,) = traj.steps
    assert s.finish_reason == "length" and s.done and s.truncated
    assert s.reward == pytest.approx(reward)


def test_observation_budget_ends_episode(codec):
    long_q = "word " * 300
    _, _, traj = _run(
        codec, [CALC, "\\boxed{7}"], row=_row(question=long_q), config=FlowConfig(max_obs_tokens=50)
    )
    assert traj.steps == [] and traj.metrics["obs_over_budget"] == 1.0
    # budget hit after one step: the last recorded step is marked truncated
    q_len = len(
        codec.encode_chat(
            _row().prompt, ToolEnv(codec, tools=["calculator", "sleepy", "boom", "rewarder"]).tool_schemas
        )
    )
    _, _, traj = _run(
        codec, [CALC, "\\boxed{7}"], config=FlowConfig(max_obs_tokens=q_len + 5, max_action_tokens=200)
    )
    assert len(traj.steps) == 1 and traj.steps[0].truncated and traj.steps[0].done


def _first_obs_len(codec):
    return len(_run(codec, ["x"])[2].steps[0].obs_token_ids)


def test_sliding_window_prefix_len(codec):
    budget = _first_obs_len(codec) + 60  # room for about one assistant/tool pair
    row = _row({"context": "sliding_window", "context_kwargs": {"max_tokens": budget}})
    _, _, traj = _run(codec, [CALC] * 5 + ["\\boxed{7}"], row=row)
    prefix_sys = codec.encode_system(
        None, ToolEnv(codec, tools=["calculator", "sleepy", "boom", "rewarder"]).tool_schemas
    )
    for prev, cur in zip(traj.steps, traj.steps[1:], strict=False):
        assert len(cur.obs_token_ids) <= budget
        assert cur.obs_token_ids[: len(prefix_sys)] == prefix_sys  # system prefix never cut
        full = prev.obs_token_ids + prev.action_token_ids
        expected = 0
        while (
            expected < min(len(full), len(cur.obs_token_ids))
            and full[expected] == cur.obs_token_ids[expected]
        ):
            expected += 1
        assert cur.prefix_len == expected
    assert any(
        s.prefix_len < len(p.obs_token_ids) + len(p.action_token_ids)
        for p, s in zip(traj.steps, traj.steps[1:], strict=False)
    )


def test_summarize_context(codec):
    row = _row(
        {
            "context": "summarize",
            "context_kwargs": {"max_tokens": _first_obs_len(codec) + 120, "keep_last": 2},
        }
    )
    _, _, traj = _run(codec, [CALC] * 5 + ["\\boxed{7}"], row=row)
    texts = [codec.decode(s.obs_token_ids) for s in traj.steps]
    assert any("Summary of earlier steps:" in t for t in texts)
    assert traj.steps[-1].reward == 1.0


@ENVS.register("test_rewrite_counter")
class CounterEnv(ToolEnv):
    """Rewrite mode: the next observation is re-rendered from a counter, not appended."""

    def __init__(self, codec, **kw: Any):
        super().__init__(codec, tools=[], context="rewrite", **kw)
        self.count = 0

    async def step(self, action):
        self.num_steps += 1
        self.count += 1
        if self.count >= 3:
            return await super().step(action)  # no tool call in the action -> done
        text = f"State: counter is {self.count}."
        self.history.turns = [Turn("user", self.codec.encode_message("user", text), text)]
        return StepResult(Observation(token_ids=self.context.view(self.history)), 0.0, False, text)


def test_rewrite_context_prefix_len(codec):
    policy = ScriptedPolicy(codec, ["a", "b", "\\boxed{3}"])
    flow = AgentEnvLoop(policy, codec, FlowConfig(), env="test_rewrite_counter")
    row = _row(truth="3")
    row.env_kwargs = {}
    traj = asyncio.run(flow.run(row, "t", "g"))
    assert len(traj.steps) == 3
    assert "counter is 2" in codec.decode(traj.steps[2].obs_token_ids)
    sys_len = len(codec.encode_system(None, None))
    # the rewritten observation shares exactly the system prefix with obs + action of the step before
    assert traj.steps[1].prefix_len == sys_len + len(codec.encode("<|im_start|>user\n"))
    assert traj.steps[2].reward == 1.0


def test_single_step_flow(codec):
    policy = ScriptedPolicy(codec, ["3 + 4 = 7. \\boxed{7}"])
    traj = asyncio.run(SingleStepFlow(policy, codec).run(_row(), "t", "g"))
    (s,) = traj.steps
    assert s.obs_token_ids == codec.encode_chat(_row().prompt) and s.done and s.reward == 1.0


def test_sampling_seed_differs_per_trajectory_and_step(codec):
    cfg = FlowConfig(sampling=SamplingParams(seed=11))
    policy = ScriptedPolicy(codec, [CALC, "\\boxed{7}", CALC, "\\boxed{7}"])
    flow = AgentEnvLoop(policy, codec, cfg)
    asyncio.run(flow.run(_row(), "a", "g"))
    asyncio.run(flow.run(_row(), "b", "g"))
    seeds = [c[1].seed for c in policy.calls]
    assert len(set(seeds)) == 4 and all(isinstance(s, int) for s in seeds)
    assert all(codec.im_end_id in c[1].stop_token_ids for c in policy.calls)


def test_unknown_env_option_is_a_clear_error(codec):
    with pytest.raises(TypeError, match="unexpected keyword|got an unexpected"):
        _run(codec, [CALC], row=_row({"max_stepz": 3}))


def test_agent_registry_lists_known():
    with pytest.raises(KeyError, match="single_step.*tool_agent"):
        AGENTS.get("nope")
