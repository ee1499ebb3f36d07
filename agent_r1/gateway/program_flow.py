"""``ExternalAgentFlow``: an episode is one run of an agent program against its gateway session.

The program (``command``, or ``callable`` = ``module:function``) gets ``OPENAI_BASE_URL`` and
``OPENAI_API_KEY`` for its session, ``AGENT_R1_REWARD_URL``, ``AGENT_R1_TASK`` (a JSON file: the
row's ``prompt``, ``reward_model``, ``extra_info``, ``env_kwargs``) and ``AGENT_R1_WORKDIR`` (its
scratch folder). Every chat completion it makes is a step (``session``). How the episode ends:

- the program posts ``{"reward": x}`` to its reward URL, or prints ``agent-r1-reward: x``: that is
  the terminal step's reward (success: ``"success"`` if posted, else x > 0);
- else it prints ``agent-r1-answer: "<json string>"`` (a callable returns the string), or just
  exits: the recipe's reward function scores that answer, or the last reply's text;
- it makes more calls than ``episode.max_steps`` or a prompt over ``episode.max_obs_tokens``: the
  call is refused, the program stopped, and the episode ends truncated with reward 0;
- it exits non-zero, runs past ``timeout_s``, or cannot start: the episode ends with
  ``info.env_error`` (counted, never trained on);
- the policy servers fail under it: the error is raised as the built-in agents raise it (the worker
  runs its share again).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from agent_r1.agent.flow import AGENTS, AgentFlow, AgentSpec
from agent_r1.data.rows import DataRow
from agent_r1.forkserver import Program
from agent_r1.gateway.programs import ANSWER_LINE, REWARD_LINE, CallableLauncher, CommandLauncher, Launcher
from agent_r1.gateway.server import Gateway
from agent_r1.gateway.session import Session
from agent_r1.records.schema import Trajectory


def _tail(path: Path, limit: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(f.tell() - limit, 0))
            return f.read().decode(errors="replace")
    except FileNotFoundError:
        return ""


def _result_lines(stdout: str) -> dict[str, Any]:
    """The program's last reward and answer lines."""
    out: dict[str, Any] = {}
    for line in stdout.splitlines():
        line = line.strip()
        try:
            if line.startswith(REWARD_LINE):
                out["reward"] = float(line[len(REWARD_LINE) :])
            elif line.startswith(ANSWER_LINE):
                out["answer"] = str(json.loads(line[len(ANSWER_LINE) :]))
        except ValueError:
            out["bad_line"] = line[:200]
    return out


class ExternalAgentFlow(AgentFlow):
    def __init__(
        self,
        generate: Any,
        codec: Any,
        config: Any = None,
        services: Any = None,
        command: list[str] | None = None,
        callable: str | None = None,  # noqa: A002 - the option's name in a recipe
        timeout_s: float = 600.0,
        output_bytes: int = 65536,
    ):
        super().__init__(generate, codec, config, services)
        if (command is None) == (callable is None):
            raise ValueError(
                "external agent: give exactly one of command (an argv list) or callable ('module:function')"
            )
        if not timeout_s > 0:
            raise ValueError(f"external agent: timeout_s must be > 0, got {timeout_s}")
        self.launcher: Launcher = (
            CommandLauncher(command) if command is not None else CallableLauncher(callable)
        )
        self.timeout_s, self.output_bytes = float(timeout_s), int(output_bytes)

    async def first_observation(self, row: DataRow) -> list[int]:
        """The row's prompt as a chat (the program may add tools or rewrite it: a lower bound)."""
        return self.codec.encode_chat_images(row.prompt)[0]

    async def run(self, row: DataRow, trajectory_id: str, group_id: str) -> Trajectory:
        gateway = Gateway.get()
        session = Session(self, trajectory_id, group_id, self.services.api_key or _session_key())
        workdir = Path(tempfile.mkdtemp(prefix="agent-r1-episode-"))
        task = {
            "prompt": row.prompt,
            "reward_model": row.reward_model,
            "extra_info": row.extra_info,
            "env_kwargs": row.env_kwargs,
            "trajectory_id": trajectory_id,
        }
        (workdir / "task.json").write_text(json.dumps(task))
        env = {
            "OPENAI_BASE_URL": gateway.open(session),
            "OPENAI_API_KEY": session.api_key,
            "AGENT_R1_REWARD_URL": gateway.reward_url(session),
            "AGENT_R1_TASK": str(workdir / "task.json"),
            "AGENT_R1_WORKDIR": str(workdir),
        }
        program: Program | None = None
        try:
            try:
                program = await self.launcher.start(task, env, workdir)
            except (OSError, ValueError, RuntimeError) as e:
                return self._finish(row, session, error=f"the agent program could not start: {e}")
            outcome = await self._wait(program, session)
            program.stop()
            if session.failure is not None:
                raise session.failure
            stdout = _tail(workdir / "stdout", self.output_bytes)
            if outcome == "timeout":
                return self._finish(
                    row, session, error=f"the agent program ran past timeout_s={self.timeout_s:g} s"
                )
            if outcome == "ended":
                return self._finish(row, session)
            if outcome != 0:
                err = _tail(workdir / "stderr", self.output_bytes).strip().splitlines()
                why = err[-1] if err else "no error output"
                return self._finish(
                    row, session, error=f"the agent program exited with status {outcome}: {why}"
                )
            return self._finish(row, session, result=_result_lines(stdout))
        finally:
            if program is not None:
                program.stop()
            gateway.close(session)
            shutil.rmtree(workdir, ignore_errors=True)

    async def _wait(self, program: Program, session: Session) -> int | str:
        """The program's exit status, ``"ended"`` (the session ended it) or ``"timeout"``."""
        exited = asyncio.ensure_future(program.exited)
        over = asyncio.ensure_future(session.over.wait())
        try:
            done, _ = await asyncio.wait(
                {exited, over}, timeout=self.timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            over.cancel()
        if exited in done and session.ended is None and session.failure is None:
            return exited.result()  # (a program that exits on a refused call ended by the session)
        program.stop()
        try:  # reap it (a zygote child is reaped by the zygote)
            await asyncio.wait_for(exited, 10)
        except (TimeoutError, RuntimeError):
            pass
        return "ended" if session.over.is_set() else "timeout"

    def _finish(
        self, row: DataRow, session: Session, error: str | None = None, result: dict[str, Any] | None = None
    ) -> Trajectory:
        traj = Trajectory(session.trajectory_id, session.group_id, session.steps)
        if not traj.steps:
            traj.metrics["no_steps"] = 1.0
            if error:
                traj.metrics["env_error"] = 1.0
            return traj
        last = traj.steps[-1]
        last.done = True
        if error is not None:
            last.reward, last.info["env_error"] = 0.0, error
            self.score(traj, row, "")
            return traj
        if session.ended is not None:  # out of steps or over budget: never scored as a success
            last.truncated, last.reward = True, 0.0
            self.score(traj, row, "")
            return traj
        result = result or {}
        last.truncated = last.finish_reason == "length"
        posted = session.reward or (
            {"reward": result["reward"], "success": result["reward"] > 0} if "reward" in result else None
        )
        if posted is not None:
            last.reward = posted["reward"]
            last.info["reward"] = {"correct": posted["success"], "source": "program"}
            self.score(traj, row, "")
        else:
            last.reward = None  # the recipe's reward function scores the answer
            answer = result.get("answer", session.final_text)
            self.score(traj, row, answer)
            last.info["reward"]["source"] = "answer" if "answer" in result else "last_reply"
        return traj


def _session_key() -> str:
    import secrets

    return secrets.token_hex(16)


AGENTS.register("external_agent")(AgentSpec(ExternalAgentFlow))
