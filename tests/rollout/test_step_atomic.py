"""Step-atomic weight updates: a push never mixes two versions inside an action. The embedded
engine's ``drain`` pause lets running actions finish on the weights they started with and admits
nothing new; past ``interrupt_tokens`` an action is interrupted instead and the workers' client
resends it as a continuation, recording which version sampled which tokens; a push that lands
while an episode is mid-way gives its later steps the new version. No test here depends on timing:
the engine is frozen at a token count from inside its own step."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from rollout_servers import ServerProc

from agent_r1.agent.env import ENVS, AgentEnv
from agent_r1.agent.flow import AgentEnvLoop, FlowConfig
from agent_r1.agent.types import Observation, StepResult
from agent_r1.data.rows import DataRow
from agent_r1.engines.embedded.engine import Engine
from agent_r1.engines.embedded.server import Server
from agent_r1.rollout.client import RolloutClient, merged_spans
from agent_r1.rollout.protocol import INTERRUPTED_MESSAGE, FinishReason, SamplingParams
from agent_r1.weights.sglang import WeightUpdateGroup, check_server_info


@pytest.fixture
def engine(tiny_model_dir):
    e = Engine(tiny_model_dir, max_running=4, max_len=256, prefill_chunk=64).start()
    yield e
    e.stop()


def _prompt(codec, text):
    return codec.encode_chat([{"role": "user", "content": text}])


def freeze_when(engine, tokens: int) -> threading.Event:
    """Freeze ``engine`` (paused in place, from inside its step: the lock is held, so no request
    can take another token) the first time a running request has ``tokens`` tokens."""
    frozen = threading.Event()
    step = engine.step

    def stepping() -> None:
        step()
        if not frozen.is_set() and any(len(r.out_ids) >= tokens for r in engine.running):
            engine.paused = "in_place"
            frozen.set()
            engine.step = step

    engine.step = stepping
    return frozen


def new_weights(engine, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = engine.model.lm_head.weight
    return {"lm_head.weight": w.detach() + 0.5 * torch.randn(w.shape, generator=g)}


def test_a_drain_lets_running_actions_finish_on_their_weights_and_admits_nothing(engine, codec):
    greedy = {"temperature": 0, "ignore_eos": True}
    (a,) = engine.make_requests(_prompt(codec, "drain a"), {**greedy, "max_new_tokens": 40}, rid="a")
    (b,) = engine.make_requests(_prompt(codec, "drain b"), {**greedy, "max_new_tokens": 4}, rid="b")
    b_done = threading.Event()
    b.on_update = lambda r, finished: finished and b_done.set()
    frozen = freeze_when(engine, 5)
    engine.submit([a])
    try:
        assert frozen.wait(60)
        engine.submit([b])  # arrives while a push is about to drain: must wait for the new weights
        assert engine.pause("drain") == 0  # returns once nothing runs
        assert a.finish["type"] == "length" and len(a.out_ids) == 40
        assert a.weight_version == "default"  # every token of it on the weights it started with
        assert b.finish is None and b.out_ids == [] and b.state == "waiting"  # not admitted
        engine.update_weights(new_weights(engine), "7")
    finally:
        engine.resume()
    assert b_done.wait(60)
    assert b.finish["type"] == "length" and b.weight_version == "7"


def test_a_drain_interrupts_actions_past_interrupt_tokens(engine, codec):
    (a,) = engine.make_requests(
        _prompt(codec, "long one"), {"temperature": 0, "max_new_tokens": 200, "ignore_eos": True}, rid="a"
    )
    frozen = freeze_when(engine, 5)
    engine.submit([a])
    try:
        assert frozen.wait(60)
        assert engine.pause("drain", interrupt_tokens=3) == 1
    finally:
        engine.resume()
    assert a.finish == {
        "type": "abort",
        "message": INTERRUPTED_MESSAGE,
        "status_code": None,
        "err_type": None,
    }
    assert len(a.out_ids) == len(a.out_logprobs) == 5


async def push_midway(engine, prompt, params, interrupt_tokens, protocol, version: str):
    """A push as a worker's client sees it, over HTTP: the action is frozen at 5 tokens, the server
    paused with the body ``protocol(server_info)`` would send it, new weights loaded as ``version``,
    generation continued. (The completion, the client's resends, the pause's answer, the body.)"""
    server = Server(engine, port=0)
    runner = await server.start()
    url = f"http://127.0.0.1:{server.port}"
    client = RolloutClient(servers=[url], interrupt_tokens=interrupt_tokens)
    try:
        body = protocol(url, await client.get(url, "/server_info")).pause_body(interrupt_tokens)
        frozen = freeze_when(engine, 5)
        action = asyncio.ensure_future(client(prompt, params))
        assert await asyncio.to_thread(frozen.wait, 60)
        paused = await client.post(url, "/pause_generation", body)
        await asyncio.to_thread(engine.update_weights, new_weights(engine, int(version)), version)
        await client.post(url, "/continue_generation", {})
        return await asyncio.wait_for(action, 60), client.resent, paused, body
    finally:
        await client.close()
        await runner.cleanup()


def test_an_interrupted_action_is_continued_on_the_new_weights_with_its_versions(engine, codec):
    """The embedded engine drains (interrupt_tokens=3): interrupted at 5 tokens, the action is
    resent with its tokens so far, waits out the update, and ends on version 7; its first 5 tokens
    and logprobs are the old weights' (as a run without the push gives them)."""
    prompt = _prompt(codec, "continue me")
    params = SamplingParams(temperature=0.0, max_new_tokens=30)
    (ref,) = engine.generate_sync(prompt, {"temperature": 0, "max_new_tokens": 30})
    done, resent, paused, body = asyncio.run(push_midway(engine, prompt, params, 3, check_server_info, "7"))
    assert body == {"mode": "drain", "interrupt_tokens": 3} and paused["interrupted"] == 1 and resent == 1
    assert done.version_spans == [[0, 5], [7, 25]] and done.policy_version == 0
    assert len(done.token_ids) == len(done.logprobs) == 30
    assert done.token_ids[:5] == ref.out_ids[:5]
    assert done.logprobs[:5] == pytest.approx(ref.out_logprobs[:5], abs=1e-5)
    assert done.finish_reason is FinishReason.LENGTH


def test_an_aborted_action_under_interrupt_tokens_is_sampled_again_on_one_version(engine, codec):
    """SGLang's push aborts in-flight actions (it has no drain): one shorter than interrupt_tokens
    is sampled again from the start on the new weights, so all of its tokens are one version's."""
    prompt = _prompt(codec, "start over")
    params = SamplingParams(temperature=0.0, max_new_tokens=20)

    def sglang(url, info):  # a real SGLang server's /server_info has no pause modes
        return check_server_info(url, {k: v for k, v in info.items() if k != "pause_modes"})

    done, resent, _, body = asyncio.run(push_midway(engine, prompt, params, 50, sglang, "8"))
    assert body == {"mode": "abort"} and resent == 1
    (fresh,) = engine.generate_sync(prompt, {"temperature": 0, "max_new_tokens": 20})
    assert done.version_spans == [] and done.policy_version == 8
    assert done.token_ids == fresh.out_ids  # the new weights' action from its first token


def test_merged_spans_join_one_versions_neighbours():
    assert merged_spans([[3, 2], [3, 4], [4, 0], [5, 1]]) == [[3, 6], [5, 1]]


# ---- an episode mid-way through a push ------------------------------------------------------------------


@ENVS.register("test_push_mid_episode")
class PushMidEpisode(AgentEnv):
    """Three steps whatever the action; ``before_step[k]`` runs (awaited) before step ``k`` ends."""

    before_step: dict[int, object] = {}

    def reset(self, **row) -> Observation:
        self.t = 0
        return Observation(messages=list(row["prompt"]))

    async def step(self, action) -> StepResult:
        hook = self.before_step.get(self.t)
        if hook is not None:
            await hook()
        self.t += 1
        if self.t == 3:
            return StepResult(None, 1.0, True)
        msgs = [{"role": "user", "content": f"go on ({self.t})"}]
        return StepResult(Observation(messages=msgs), None, False, feedback=f"go on ({self.t})")


def test_a_push_mid_episode_gives_the_later_steps_the_new_version(tiny_model_dir, codec, tmp_path):
    """A real push (the trainer's update group, drain pause) lands after the episode's first step:
    step 0 carries the version it was sampled with, steps 1 and 2 the pushed one; nothing restarts."""
    server = ServerProc(tiny_model_dir, tmp_path, "s")
    try:
        from safetensors.torch import load_file

        original = load_file(str(tiny_model_dir / "model.safetensors"))
        g = torch.Generator().manual_seed(5)
        pushed = {n: t + 0.01 * torch.randn(t.shape, generator=g) for n, t in original.items()}

        async def push():
            group = WeightUpdateGroup([server.url])
            await group.init(timeout_s=60)
            try:
                await group.push(pushed.items(), 3)
            finally:
                await group.close()

        PushMidEpisode.before_step = {0: push}

        async def episode():
            client = RolloutClient(servers=[server.url], interrupt_tokens=0)
            flow = AgentEnvLoop(
                client.session("t0"),
                codec,
                FlowConfig(max_steps=3, max_action_tokens=6),
                env="test_push_mid_episode",
            )
            row = DataRow(
                prompt=[{"role": "user", "content": "hi"}],
                agent_name="tool_agent",
                reward_model={"style": "math_number", "ground_truth": "1"},
                data_source="test",
            )
            try:
                return await flow.run(row, "t0", "g0")
            finally:
                await client.close()

        traj = asyncio.run(episode())
    finally:
        PushMidEpisode.before_step = {}
        server.kill()
    assert [s.policy_version for s in traj.steps] == [0, 3, 3]
    assert all("version_spans" not in s.info for s in traj.steps)
