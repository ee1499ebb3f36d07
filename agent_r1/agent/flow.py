"""Agent flows: run one episode against a ``generate`` callable and record every step.

``AgentFlow`` is the async base (full control); ``AgentEnvLoop`` is the generic reset/step loop
over an ``AgentEnv``; ``SingleStepFlow`` is one prompt, one response. Each step becomes a
``StepRecord`` with the observation and action token ids exactly as sent and sampled.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Any

from agent_r1.agent.chat import ChatCodec
from agent_r1.agent.env import make_env
from agent_r1.agent.episode import EpisodeSettings, FlowConfig
from agent_r1.agent.types import Action, GenerateFn, Observation, StepResult
from agent_r1.agent_tools.services import NO_SERVICES, Services
from agent_r1.data.rows import DataRow
from agent_r1.records.schema import StepRecord, Trajectory
from agent_r1.registry import Registry
from agent_r1.rewards import compute_reward
from agent_r1.rollout.protocol import image_kwargs
from agent_r1.vision.images import Image, load_image


def step_images(images: list[Image], seen: set[str]) -> dict[str, Any]:
    """A step record's image fields: the observation's image hashes, and the bytes of those not
    stored with an earlier step of the trajectory (``seen``, updated)."""
    new = {im.hash: im.data for im in images if im.hash not in seen}
    seen.update(new)
    return {"images": [im.hash for im in images], "image_data": new}


def action_step(
    trajectory_id: str, group_id: str, t: int, obs_ids: list[int], action: Action, **fields: Any
) -> StepRecord:
    """Step ``t``'s record: the observation and the action exactly as sampled (ids, logprobs,
    mask, version, finish reason), with the flow's other ``fields``."""
    step = StepRecord(
        trajectory_id=trajectory_id,
        group_id=group_id,
        step_index=t,
        obs_token_ids=obs_ids,
        action_token_ids=action.token_ids,
        action_logprobs=action.logprobs,
        action_mask=list(action.mask or []),
        policy_version=action.policy_version,
        finish_reason=action.finish_reason.value,
        **fields,
    )
    if action.version_spans:  # which version sampled which tokens of an interrupted action
        step.info["version_spans"] = [list(s) for s in action.version_spans]
    return step


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class AgentFlow:
    def __init__(
        self,
        generate: GenerateFn,
        codec: ChatCodec,
        config: FlowConfig | None = None,
        services: Services | None = None,
    ):
        self.generate, self.codec, self.config = generate, codec, config or EpisodeSettings().flow()
        self.services = services or NO_SERVICES  # handed to the episode's environment

    async def run(self, row: DataRow, trajectory_id: str, group_id: str) -> Trajectory:
        raise NotImplementedError

    async def first_observation(self, row: DataRow) -> list[int]:
        """The token ids of the row's first observation, built as ``run`` builds it (pre-flight
        checks use it: a bad env option or prompt fails here, before any rollout)."""
        raise NotImplementedError

    # ---- helpers shared by flows -----------------------------------------------------------------
    def obs_prompt(
        self, obs: Observation, tools: list[dict[str, Any]] | None = None
    ) -> tuple[list[int], list[Image]]:
        """The observation's token ids and its images (one per ``<|image_pad|>`` run, in order)."""
        if obs.token_ids is not None:
            images = [load_image(x, f"observation image {i}") for i, x in enumerate(obs.images or [])]
            self.codec.check_image_pads(obs.token_ids, images)
            return list(obs.token_ids), images
        if obs.images:
            raise ValueError(
                "Observation.images goes with token_ids; chat messages carry images as content parts"
            )
        if obs.messages is not None:
            return self.codec.encode_chat_images(obs.messages, tools)
        return self.codec.encode(obs.text or ""), []

    async def act(
        self,
        obs_ids: list[int],
        trajectory_id: str,
        step: int,
        images: list[Image] | None = None,
        max_new_tokens: int | None = None,
    ) -> Action:
        """One action under the episode's sampling; ``max_new_tokens`` may only shorten the
        episode's action budget (an agent program's ``max_tokens``)."""
        s = self.config.sampling
        seed = None
        if s.seed is not None:  # reproducible and different for every trajectory and step
            seed = (
                int.from_bytes(
                    hashlib.sha256(f"{s.seed}/{trajectory_id}/{step}".encode()).digest()[:4], "little"
                )
                >> 1
            )
        sampling = dataclasses.replace(
            s,
            max_new_tokens=min(
                s.max_new_tokens, self.config.max_action_tokens, max_new_tokens or s.max_new_tokens
            ),
            stop_token_ids=sorted(set(s.stop_token_ids) | set(self.codec.stop_token_ids)),
            seed=seed,
        )
        out = await self.generate(obs_ids, sampling, **image_kwargs(images))
        return Action(
            text=self.codec.decode_action(out.token_ids),
            token_ids=list(out.token_ids),
            logprobs=list(out.logprobs),
            finish_reason=out.finish_reason,
            policy_version=out.policy_version,
            version_spans=list(out.version_spans),
        )

    @staticmethod
    def score(traj: Trajectory, row: DataRow, final_text: str) -> None:
        """Outcome reward for the terminal step when the environment left it unscored."""
        last = traj.steps[-1]
        if last.reward is None:
            res = compute_reward(row.reward_model, final_text)
            last.reward = res.score
            last.info["reward"] = {
                "correct": res.correct,
                "formatted": res.formatted,
                "prediction": res.prediction,
            }
            if res.details.get("metrics"):  # task metrics besides success (F1, recall): logged as task/*
                last.info["reward"]["metrics"] = res.details["metrics"]
            traj.metrics["success"] = float(res.correct)
        elif isinstance(last.info.get("reward"), dict):  # the environment scored its own episode
            traj.metrics["success"] = float(bool(last.info["reward"].get("correct")))
        if last.info.get("env_error"):  # the environment died under the episode: not trainable
            traj.metrics["env_error"] = 1.0
        traj.metrics["reward"] = traj.total_reward
        traj.metrics["num_steps"] = float(len(traj.steps))
        traj.metrics["num_tool_calls"] = float(traj.num_tool_calls)
        traj.metrics["action_tokens"] = float(sum(len(s.action_token_ids) for s in traj.steps))


class AgentEnvLoop(AgentFlow):
    """reset -> (generate -> env.step)* until done, max_steps, or the observation budget."""

    def __init__(
        self,
        generate: GenerateFn,
        codec: ChatCodec,
        config: FlowConfig | None = None,
        services: Services | None = None,
        env: str = "tool",
        **env_kwargs: Any,
    ):
        super().__init__(generate, codec, config, services)
        self.env_name, self.env_kwargs = env, env_kwargs

    async def _start(self, row: DataRow) -> tuple[Any, Observation]:
        """The row's environment (defaults + the row's options) and its first observation."""
        env = make_env(self.env_name, self.codec, self.services, **{**self.env_kwargs, **row.env_kwargs})
        env.flow_max_steps = self.config.max_steps
        try:
            return env, env.reset(prompt=row.prompt, reward_model=row.reward_model, extra_info=row.extra_info)
        except BaseException:
            await env.close()
            raise

    async def first_observation(self, row: DataRow) -> list[int]:
        env, obs = await self._start(row)
        try:
            return self.obs_prompt(obs, env.tool_schemas)[0]
        finally:
            await env.close()

    async def run(self, row: DataRow, trajectory_id: str, group_id: str) -> Trajectory:
        env, obs = await self._start(row)
        traj = Trajectory(trajectory_id, group_id)
        try:
            prev: list[int] = []
            seen: set[str] = set()  # images already stored with an earlier step
            action = None
            for t in range(self.config.max_steps):
                ids, images = self.obs_prompt(obs, env.tool_schemas)
                if len(ids) > self.config.max_obs_tokens:
                    traj.metrics["obs_over_budget"] = 1.0
                    if traj.steps:
                        traj.steps[-1].done = traj.steps[-1].truncated = True
                    break
                action = await self.act(ids, trajectory_id, t, images)
                if self.codec.vision_token_ids.intersection(action.token_ids):
                    # a vision model sampled its image markup: the next prompt would read it as an
                    # image, so the episode ends here (the step is trained on, as sampled)
                    traj.metrics["vision_token_sampled"] = 1.0
                    res = StepResult(None, None, True, info={"truncated": True, "vision_token_sampled": True})
                else:
                    res = await env.step(action)
                last = res.done or t == self.config.max_steps - 1
                traj.steps.append(
                    action_step(
                        trajectory_id,
                        group_id,
                        t,
                        ids,
                        action,
                        prefix_len=common_prefix_len(ids, prev),
                        feedback=res.feedback,
                        reward=res.reward if (not last or res.done) else None,
                        process_reward=res.process_reward,
                        done=last,
                        truncated=bool(res.info.get("truncated")) or (last and not res.done),
                        info=res.info,
                        **step_images(images, seen),
                    )
                )
                if last:
                    break
                assert res.observation is not None, (
                    f"env {self.env_name!r} returned no observation while not done"
                )
                obs, prev = res.observation, ids + action.token_ids
        finally:
            await env.close()
        if traj.steps and action is not None:
            self.score(traj, row, action.text)
        return traj


class SingleStepFlow(AgentFlow):
    """One prompt, one response, scored by the row's reward model."""

    async def first_observation(self, row: DataRow) -> list[int]:
        return self.codec.encode_chat_images(row.prompt)[0]

    async def run(self, row: DataRow, trajectory_id: str, group_id: str) -> Trajectory:
        ids, images = self.codec.encode_chat_images(row.prompt)
        traj = Trajectory(trajectory_id, group_id)
        if len(ids) > self.config.max_obs_tokens:
            traj.metrics["obs_over_budget"] = 1.0
            return traj
        action = await self.act(ids, trajectory_id, 0, images)
        traj.steps.append(
            action_step(
                trajectory_id,
                group_id,
                0,
                ids,
                action,
                done=True,
                truncated=action.finish_reason.is_truncated(),
                **step_images(images, set()),
            )
        )
        self.score(traj, row, action.text)
        return traj


@dataclass(frozen=True)
class AgentSpec:
    """A named agent: a flow class plus default env options (rows may override env options)."""

    flow: type[AgentFlow]
    options: dict[str, Any] = field(default_factory=dict)

    def build(
        self,
        generate: GenerateFn,
        codec: ChatCodec,
        config: FlowConfig | None = None,
        services: Services | None = None,
    ) -> AgentFlow:
        return self.flow(generate, codec, config, services, **self.options)


AGENTS: Registry[AgentSpec] = Registry("agent")
AGENTS.register("single_step")(AgentSpec(SingleStepFlow))
AGENTS.register("tool_agent")(AgentSpec(AgentEnvLoop, {"env": "tool"}))
