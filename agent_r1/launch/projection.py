"""What streaming buys on a cluster, before asking for one: a small discrete-event model of the
three rollout modes (``docs/training.md``) on N rollout and M learner GPUs.

A workload is the episodes of each iteration, each with its steps' generation times and tool
latencies (drawn heavy-tailed with a fixed seed, or given); rollout GPUs hold a bounded number of
episodes at once (``slots``), an update costs ``update_s`` (per step record trained, plus a
fixed part: the weight push). The modes differ only in when an iteration's episodes may start, as
the coordinator issues tasks:

- ``sync``: iteration i's episodes start once update i-1 has been pushed; update i starts once its
  last episode ends.
- ``one_step_off`` (``rollout.mode=async``, eta=1): iteration i's episodes start once update i-2 is
  pushed and iteration i-1's episodes have all ended (a worker runs its tasks in turn).
- ``stream`` (eta): iteration i's episodes start once update i-1-eta is pushed, beside every
  earlier iteration's (older iterations first when the slots are full).

It answers trained step records per second, the learner's and the rollout slots' idle fractions;
``agent-r1 plan`` prints it for a preset (``tools/bench/stream.py`` measures the real modes).
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Episode:
    steps: int
    seconds: float  # generation and tool time from its first step to its last


@dataclass(frozen=True)
class Outcome:
    mode: str
    steps_per_s: float
    seconds: float
    learner_idle: float  # fraction of the run the learner waited
    rollout_idle: float  # fraction of slot-seconds no episode held


def heavy_tail(rng: random.Random, alpha: float, minimum: float, cap: float) -> float:
    """A Pareto(``alpha``) draw of minimum ``minimum``, capped at ``cap``."""
    return min(cap, minimum * rng.paretovariate(alpha))


def long_tail_workload(
    iterations: int,
    episodes: int,
    token_s: float,
    seed: int = 0,
    max_steps: int = 8,
    tokens: float = 48.0,
    tool_s: float = 0.05,
    steps_alpha: float = 1.3,
    tool_alpha: float = 1.2,
    max_tool_s: float = 2.0,
) -> list[list[Episode]]:
    """Episodes of ``max_steps`` at most (Pareto(``steps_alpha``) steps, the last an answer), each
    step generating ``tokens`` at ``token_s`` per token and calling a tool of Pareto(``tool_alpha``)
    latency from ``tool_s`` (one latency per episode, as arithmetic_longtail's jobs)."""
    rng = random.Random(seed)
    out = []
    for _ in range(iterations):
        batch = []
        for _ in range(episodes):
            calls = int(heavy_tail(rng, steps_alpha, 1.0, max_steps - 1))
            latency = heavy_tail(rng, tool_alpha, tool_s, max_tool_s)
            batch.append(Episode(calls + 1, (calls + 1) * tokens * token_s + calls * latency))
        out.append(batch)
    return out


def simulate(
    mode: str,
    work: list[list[Episode]],
    slots: int,
    update_s: float,
    update_per_step_s: float = 0.0,
    eta: int = 1,
) -> Outcome:
    """Run ``work`` (episodes per iteration) through ``slots`` rollout slots and one learner."""
    if mode not in ("sync", "one_step_off", "stream"):
        raise ValueError(f"mode: sync, one_step_off or stream, got {mode!r}")
    n = len(work)
    pushed = [0.0] * n  # when update i's weights reach the servers
    gen_end = [0.0] * n
    free = [0.0] * slots  # when each slot is next free (a heap)
    busy = 0.0
    learner_busy = 0.0
    admitted = 0  # iterations whose episodes are placed in the slots, oldest first
    for i in range(n):  # before update i: place every iteration its mode admits by then
        while admitted < n and admitted <= i + (eta if mode == "stream" else 0):
            k = admitted
            if mode == "sync":
                start = pushed[k - 1] if k else 0.0
            elif mode == "one_step_off":
                start = max(pushed[k - 2] if k >= 2 else 0.0, gen_end[k - 1] if k else 0.0)
            else:
                start = pushed[k - 1 - eta] if k - 1 - eta >= 0 else 0.0
            end = start
            for e in sorted(work[k], key=lambda e: -e.seconds):  # longest first: a fair packing
                slot_free = heapq.heappop(free)
                begin = max(slot_free, start)
                heapq.heappush(free, begin + e.seconds)
                busy += e.seconds
                end = max(end, begin + e.seconds)
            gen_end[k] = end
            admitted += 1
        cost = update_s + update_per_step_s * sum(e.steps for e in work[i])
        begin = max(gen_end[i], pushed[i - 1] if i else 0.0)
        pushed[i] = begin + cost
        learner_busy += cost
    total = pushed[-1]
    steps = sum(e.steps for batch in work for e in batch)
    return Outcome(
        mode if mode != "stream" else f"stream_eta{eta}",
        steps / total,
        total,
        1.0 - learner_busy / total,
        1.0 - busy / (slots * total),
    )


def compare(
    work: list[list[Episode]], slots: int, update_s: float, update_per_step_s: float, etas=(1, 2, 4)
) -> list[Outcome]:
    """sync, one-step-off and stream at each eta on the same work."""
    return [
        simulate("sync", work, slots, update_s, update_per_step_s),
        simulate("one_step_off", work, slots, update_s, update_per_step_s),
        *(simulate("stream", work, slots, update_s, update_per_step_s, eta) for eta in etas),
    ]


def table(outcomes: list[Outcome]) -> list[str]:
    base = {o.mode: o.steps_per_s for o in outcomes}
    return [
        f"  {o.mode:14s} {o.steps_per_s:10.1f} trained steps/s   x{o.steps_per_s / base['sync']:.2f} sync"
        f"   x{o.steps_per_s / base['one_step_off']:.2f} one-step-off   learner idle {o.learner_idle:4.0%}"
        f"   rollout idle {o.rollout_idle:4.0%}"
        for o in outcomes
    ]
