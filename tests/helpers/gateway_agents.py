"""Agent callables for the gateway's tests (forked from a zygote that imports this module)."""

from __future__ import annotations

import subprocess
import time


def hang(task: dict) -> None:
    """Starts a grandchild, makes one call, then never returns."""
    import openai

    subprocess.Popen(["sleep", "302.5"])
    openai.OpenAI(max_retries=0).chat.completions.create(model="m", messages=task["prompt"])
    time.sleep(1000)


def reward(task: dict) -> float:
    """One call, then a reward as its return value."""
    import openai

    openai.OpenAI(max_retries=0).chat.completions.create(model="m", messages=task["prompt"])
    return 0.25
