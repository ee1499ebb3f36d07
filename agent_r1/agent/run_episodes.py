"""Run a batch of episodes concurrently: rows x group size -> trajectories (with a progress bar)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from tqdm import tqdm

from agent_r1.agent.chat import ChatCodec
from agent_r1.agent.flow import AGENTS, FlowConfig
from agent_r1.agent.types import GenerateFn
from agent_r1.agent_tools.services import Services
from agent_r1.data.rows import DataRow
from agent_r1.records.schema import Trajectory


async def run_episodes(
    rows: Sequence[DataRow],
    generate: GenerateFn,
    codec: ChatCodec,
    config: FlowConfig,
    group_size: int = 1,
    id_prefix: str = "it0",
    max_concurrency: int = 64,
    progress: bool = True,
    on_episode: Callable[[int], None] | None = None,
    services: Services | None = None,
) -> list[Trajectory]:
    """One trajectory per (row, sample); ``group_id`` = the row, shared by its ``group_size`` samples."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    sem = asyncio.Semaphore(max_concurrency)
    bar = tqdm(total=len(rows) * group_size, desc="episodes", unit="ep", disable=not progress, leave=False)

    async def one(row: DataRow, i: int, k: int) -> Trajectory:
        async with sem:
            tid = f"{id_prefix}-p{i}-s{k}"
            # a client that routes by session keeps every step of a trajectory on one server
            gen = generate.session(tid) if hasattr(generate, "session") else generate
            flow = AGENTS.get(row.agent_name).build(gen, codec, config, services)
            traj = await flow.run(row, tid, f"{id_prefix}-p{i}")
            bar.update(1)
            if on_episode is not None:
                on_episode(bar.n)
            return traj

    try:
        return list(
            await asyncio.gather(*(one(r, i, k) for i, r in enumerate(rows) for k in range(group_size)))
        )
    finally:
        bar.close()
