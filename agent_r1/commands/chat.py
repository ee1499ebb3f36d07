"""``agent-r1 chat``: talk to a model with a recipe's tools in the terminal.

The conversation runs through the environment and agent code of training: the recipe's
environment (or a ``ToolEnv`` with ``--tools``) builds every observation, ``AgentFlow.act`` samples
every action, tool calls run as in a rollout. What you chat with is what you train. Tokens stream
as they are generated; tool calls and tool results are shown apart from the answer.

Commands: ``/reset`` (a new conversation), ``/save FILE`` (the conversation's step records as an
Arrow file, as ``agent-r1 rollout --out`` writes), ``/tools``, ``/quit`` (or Ctrl-D). A line ending in
``\\`` continues on the next line. Ctrl-C stops a generation (the session goes on).
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path
from typing import Any

HELP = (
    "commands: /reset  /save FILE  /tools  /quit   (end a line with \\ to continue it; Ctrl-C stops a reply)"
)


class Style:
    def __init__(self, color: bool):
        c = (lambda code: f"\033[{code}m") if color else (lambda code: "")
        self.reset, self.dim, self.tool, self.result, self.err, self.you = (
            c("0"), c("2"), c("36"), c("33"), c("31"), c("1;32"),
        )  # fmt: skip


class StreamingGenerate:
    """A ``GenerateFn`` over SGLang's streaming ``/generate``: prints text as it arrives (holding
    back a ``<tool_call>`` block, which the session prints parsed), returns the whole completion."""

    def __init__(self, url: str, api_key: str | None, write: Any, codec: Any):
        self.url, self.write, self.codec = url.rstrip("/"), write, codec
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session = None

    async def session(self) -> Any:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(headers=self.headers)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def _text(self, chunk: dict[str, Any]) -> str:
        """The reply so far, special tokens kept (``<tool_call>`` may be one): from the ids when
        the server streams them (cumulative, as SGLang and agent-r1 serve do by default)."""
        ids = chunk.get("output_ids")
        return self.codec.decode_action(ids) if ids is not None else chunk.get("text", "")

    async def __call__(self, token_ids: list[int], sampling: Any, images: list[Any] | None = None) -> Any:
        from agent_r1.rollout.client import RolloutError, to_completion

        body = {
            "input_ids": token_ids,
            "sampling_params": sampling.to_wire(),
            "return_logprob": True,
            "stream": True,
        }
        if images:
            body["image_data"] = [im.base64() for im in images]
        http = await self.session()
        shown, last = 0, None
        async with http.post(f"{self.url}/generate", json=body) as r:
            if r.status != 200:
                raise RolloutError(f"{self.url}/generate answered {r.status}: {(await r.text())[:300]}")
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                last = json.loads(line[5:])
                visible = self.codec.content(self._text(last), final=False)  # no tool-call text
                if len(visible) > shown and not visible.endswith("\ufffd"):
                    self.write(visible[shown:])
                    shown = len(visible)
        if last is None:
            raise RolloutError(f"{self.url}/generate streamed nothing")
        text = self.codec.content(self._text(last))
        if len(text) > shown:
            self.write(text[shown:])
        return to_completion(last)


class ChatSession:
    def __init__(
        self,
        codec: Any,
        generate: StreamingGenerate,
        template: Any,
        flow_cfg: Any,
        style: Style,
        out: Any,
        services: Any = None,
    ):
        from agent_r1.agent.flow import AGENTS, AgentFlow

        self.codec, self.generate, self.template, self.style, self.out = codec, generate, template, style, out
        self.flow = AgentFlow(generate, codec, flow_cfg, services)
        spec = AGENTS.get(template.agent_name)
        self.env_name = spec.options.get("env", "tool")
        self.env_kwargs = {**{k: v for k, v in spec.options.items() if k != "env"}, **template.env_kwargs}
        self.env: Any = None
        self.steps: list[Any] = []
        self.seen_images: dict[str, set[str]] = {}  # per trajectory: images stored with a step
        self.conversations = 0

    def say(self, text: str, color: str = "") -> None:
        self.out.write(f"{color}{text}{self.style.reset if color else ''}")
        self.out.flush()

    def make_env(self) -> Any:
        from agent_r1.agent.env import make_env

        return make_env(self.env_name, self.codec, self.flow.services, **self.env_kwargs)

    async def reset(self) -> None:
        if self.env is not None:
            await self.env.close()
        self.env, self.steps, self.seen_images = None, [], {}
        self.conversations += 1

    def tool_names(self) -> list[str]:
        env = self.env or self.make_env()
        return [t["function"]["name"] for t in getattr(env, "tool_schemas", [])]

    async def user(self, text: str) -> None:
        """One user message: the agent acts (tool calls and results shown) until it answers."""
        from agent_r1.agent.flow import common_prefix_len, step_images
        from agent_r1.records.schema import StepRecord

        if self.env is None or not getattr(self.env, "CHAT_CONTINUES", False):
            if self.env is not None:
                await self.env.close()
            self.env = self.make_env()
            obs = self.env.reset(prompt=self.template.prompt + [{"role": "user", "content": text}])
        else:
            obs = await self.env.add_user_message(text)
        tid = f"chat{self.conversations}"
        prev: list[int] = []
        for _ in range(self.flow.config.max_steps):
            ids, images = self.flow.obs_prompt(obs, self.env.tool_schemas)
            if len(ids) > self.flow.config.max_obs_tokens:
                self.say(
                    f"[the conversation is longer than {self.flow.config.max_obs_tokens} tokens: /reset]\n",
                    self.style.err,
                )
                return
            self.say("agent> ", self.style.dim)
            action = await self.flow.act(ids, tid, len(self.steps), images)
            self.say("\n")
            res = await self.env.step(action)
            self.steps.append(
                StepRecord(
                    trajectory_id=tid, group_id=tid, step_index=len(self.steps), obs_token_ids=ids,
                    action_token_ids=action.token_ids, action_logprobs=action.logprobs,
                    action_mask=list(action.mask or []), policy_version=action.policy_version,
                    prefix_len=common_prefix_len(ids, prev), feedback=res.feedback,
                    reward=res.reward if res.reward is not None else 0.0, process_reward=res.process_reward,
                    done=res.done, truncated=bool(res.info.get("truncated")),
                    finish_reason=action.finish_reason.value, info=res.info,
                    **step_images(images, self.seen_images.setdefault(tid, set())),
                )
            )  # fmt: skip
            for call, line in zip(res.info.get("tool_calls", []), self._calls(action.text), strict=False):
                self.say(f"  [tool] {line}\n", self.style.tool)
                if call.get("error"):
                    self.say(f"  [error] {call['error']}\n", self.style.err)
            if res.feedback and res.info.get("tool_calls"):
                for block in res.feedback.split("<tool_response>")[1:]:
                    self.say(f"  [result] {block.split('</tool_response>')[0].strip()}\n", self.style.result)
            if action.finish_reason.is_truncated():
                self.say("  [cut at the action token limit]\n", self.style.err)
            if res.done:
                return
            obs, prev = res.observation, ids + action.token_ids
        self.say(f"  [stopped after {self.flow.config.max_steps} steps]\n", self.style.err)

    def _calls(self, text: str) -> list[str]:
        from agent_r1.agent.tool_calls import MalformedCall

        out = []
        for c in self.codec.parse_tool_calls(text):
            if isinstance(c, MalformedCall):
                out.append(f"(malformed) {c.raw.strip()[:200]}")
            else:
                out.append(f"{c.name}({json.dumps(c.arguments, ensure_ascii=False)})")
        return out

    def save(self, path: str) -> int:
        from agent_r1.records.shard import write_records_file

        return write_records_file(path, self.steps)


def read_message(style: Style) -> str | None:
    """One user message (``\\`` at a line's end continues it); None at end of input."""
    lines: list[str] = []
    while True:
        try:
            line = input(f"{style.you}you>{style.reset} " if not lines else "...  ")
        except EOFError:
            return None
        if line.endswith("\\"):
            lines.append(line[:-1])
            continue
        lines.append(line)
        return "\n".join(lines).strip()


def add_parser(sub: Any) -> None:
    from agent_r1.commands.flags import add_episode_flags, add_policy_flags
    from recipes import RECIPES

    ch = sub.add_parser("chat", help="talk to a model with a recipe's tools in the terminal")
    add_policy_flags(ch)
    ch.add_argument("--recipe", default=None, choices=RECIPES, help="its agent, tools and system prompt")
    ch.add_argument("--tools", default=None, help="a tool agent with these tools: calculator,search")
    ch.add_argument("--system", default=None, help="the system prompt (default: the recipe's)")
    ch.add_argument("--index", default=None, help="the search tool's index")
    add_episode_flags(ch)
    ch.add_argument("--export-dir", default="chat_models", help="where --run's checkpoint is exported")
    ch.add_argument("--no-color", action="store_true")
    ch.set_defaults(fn=run)


def run(a: Any) -> int:
    import logging

    logging.basicConfig(level=logging.WARNING)  # the terminal is the chat's
    return run_chat(a)


def run_chat(a: Any) -> int:
    from agent_r1.commands.infer import parse_tools
    from agent_r1.commands.policy_source import resolve_policy, serving
    from recipes import load_all

    load_all()
    tools = parse_tools(a.tools)
    with serving(resolve_policy(a, Path(a.export_dir)), a, announce=True) as policy:
        return chat_loop(a, policy, tools)


def chat_loop(a: Any, policy: Any, tools: list[str] | None) -> int:
    from agent_r1.commands.infer import open_prompt_template

    codec = policy.codec
    template = open_prompt_template(a.recipe, tools)
    if a.system:
        template.prompt = [{"role": "system", "content": a.system}]
    style = Style(sys.stdout.isatty() and not a.no_color)
    url = policy.urls[0]
    out = sys.stdout
    gen = StreamingGenerate(url, a.api_key, lambda s: (out.write(s), out.flush()), codec)
    session = ChatSession(codec, gen, template, policy.episode.flow(a.seed), style, out, policy.services)
    loop = asyncio.new_event_loop()
    print(
        f"chat with {policy.source} ({url}); tools: {', '.join(session.tool_names()) or 'none'}\n{HELP}",
        flush=True,
    )
    try:
        while True:
            try:
                msg = read_message(style)
            except KeyboardInterrupt:
                print("\n(Ctrl-C: /quit or Ctrl-D leaves)", flush=True)
                continue
            if msg is None or msg == "/quit":
                break
            if not msg:
                continue
            if msg == "/reset":
                loop.run_until_complete(session.reset())
                print("(new conversation)", flush=True)
            elif msg == "/tools":
                print(f"tools: {', '.join(session.tool_names()) or 'none'}", flush=True)
            elif msg.startswith("/save"):
                path = msg[len("/save") :].strip()
                if not path:
                    print("usage: /save FILE", flush=True)
                else:
                    print(f"saved {session.save(path)} step records to {path}", flush=True)
            elif msg.startswith("/"):
                print(f"unknown command {msg.split()[0]}; {HELP}", flush=True)
            else:
                task = loop.create_task(session.user(msg))
                # Ctrl-C cancels the reply inside the loop (the request is dropped, the server aborts it)
                loop.add_signal_handler(signal.SIGINT, task.cancel)
                try:
                    loop.run_until_complete(task)
                except (asyncio.CancelledError, KeyboardInterrupt):
                    if not task.done():
                        task.cancel()
                        try:
                            loop.run_until_complete(task)
                        except (asyncio.CancelledError, KeyboardInterrupt):
                            pass
                    print("\n(stopped)", flush=True)
                except Exception as e:  # noqa: BLE001 - a dead server, a bad reply: the session goes on
                    print(f"\n[error] {type(e).__name__}: {e}", flush=True)
                finally:
                    loop.remove_signal_handler(signal.SIGINT)  # at the prompt: the hint below
    finally:
        loop.run_until_complete(session.reset())
        loop.run_until_complete(gen.close())
        loop.close()
    return 0
