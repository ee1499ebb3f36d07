"""`agent-r1 chat` in a real terminal (tmux: keys sent, the screen read): the tiny model taught a
calculator call asks for it, the tool runs, its result shows; Ctrl-C stops a reply and the session
goes on; multi-line input, /tools, /save (step records), /reset, Ctrl-C at the prompt, /quit; bad
arguments are one-line errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import pyarrow as pa
import pytest

from agent_r1.agent.chat import ChatCodec

pytestmark = pytest.mark.skipif(
    shutil.which("tmux") is None, reason="tmux not installed (make install adds it)"
)


class Tmux:
    def __init__(self, name: str, cmd: list[str], cwd):
        self.name = name
        shell = " ".join(f"'{c}'" for c in cmd) + "; echo CHAT-EXITED $?; sleep 30"
        subprocess.run(["tmux", "kill-session", "-t", name], capture_output=True)
        subprocess.run(
            ["tmux", "new-session", "-d", "-s", name, "-x", "220", "-y", "60", "-c", str(cwd), shell],
            check=True,
        )

    def screen(self) -> str:
        r = subprocess.run(
            ["tmux", "capture-pane", "-p", "-J", "-S", "-500", "-t", self.name],
            capture_output=True,
            text=True,
        )
        return r.stdout

    def keys(self, *keys: str) -> None:
        subprocess.run(["tmux", "send-keys", "-t", self.name, *keys], check=True)

    def type(self, line: str) -> None:
        self.keys("-l", line)
        self.keys("Enter")

    def wait(self, text: str, after: int = 0, timeout: float = 120) -> str:
        deadline = time.time() + timeout
        while time.time() < deadline:
            s = self.screen()
            if s.count(text) > after:
                return s
            time.sleep(0.2)
        raise AssertionError(f"{text!r} did not appear on the screen:\n{self.screen()}")

    def close(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.name], capture_output=True)


def _records(path):
    with pa.OSFile(str(path), "rb") as f:
        return pa.ipc.open_file(f).read_all().to_pylist()


def test_chat_in_a_terminal(tool_model, tmp_path):
    cmd = [sys.executable, "-m", "agent_r1.cli", "chat", "--model", str(tool_model), "--tools", "calculator",
           "--max-steps", "2", "--max-action-tokens", "1500", "--max-len", "4096"]  # fmt: skip
    t = Tmux(f"agent-r1-chat-{time.time_ns()}", cmd, tmp_path)
    try:
        t.wait("you>")
        assert "tools: calculator" in t.screen()
        t.type("What is 12 * 7?")
        s = t.wait("[result]")
        assert '[tool] calculator({"expression": "12 * 7"})' in s and "[result] 84" in s, s
        assert "<tool_call>" not in s  # the raw call is shown parsed, not as streamed text
        # the second step rambles on (the model learnt one call only): Ctrl-C stops it, not the chat
        t.keys("C-c")
        t.wait("(stopped)")
        t.wait("you>", after=1)
        t.type("/tools")
        t.wait("tools: calculator", after=1)
        t.type("/save one.arrow")
        t.wait("saved")
        steps = _records(tmp_path / "one.arrow")
        assert len(steps) == 1 and steps[0]["trajectory_id"] == "chat0" and steps[0]["step_index"] == 0
        info = json.loads(steps[0]["info"])
        assert info["tool_calls"][0]["name"] == "calculator" and not info["tool_calls"][0].get("error")
        codec = ChatCodec.load(str(tool_model))
        assert codec.decode(steps[0]["action_token_ids"]).startswith("<tool_call>")
        # a new conversation; a message over two lines; Ctrl-C at the prompt keeps the session
        t.type("/reset")
        t.wait("(new conversation)")
        t.keys("C-c")
        t.wait("(Ctrl-C: /quit or Ctrl-D leaves)")
        prompts = t.screen().count("you>")
        t.type("first line \\")
        t.type("second line")
        t.wait("agent>", after=2)
        t.wait("you>", after=prompts)  # answered: the prompt is back
        t.type("/save two.arrow")
        t.wait("saved", after=1)
        two = _records(tmp_path / "two.arrow")
        assert two and all(s["trajectory_id"] == "chat1" for s in two), (
            t.screen()
        )  # only the new conversation
        assert "first line \nsecond line" in codec.decode(two[0]["obs_token_ids"])
        t.type("/quit")
        t.wait("CHAT-EXITED 0")
    finally:
        t.close()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--tools", "nope"], "--tools: no tool named 'nope'"),
        (["--model", "/nonexistent"], "not an HF model folder"),
    ],
)
def test_chat_bad_arguments(tiny_model_dir, args, says):
    base = ["--model", str(tiny_model_dir)] if "--model" not in args else []
    r = subprocess.run([sys.executable, "-m", "agent_r1.cli", "chat", *base, *args], capture_output=True,
                       text=True, timeout=60, stdin=subprocess.DEVNULL)  # fmt: skip
    assert r.returncode != 0 and says in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
