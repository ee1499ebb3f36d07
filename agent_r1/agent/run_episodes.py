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
    first_index: int = 0,
    limit: asyncio.Semaphore | None = None,
) -> list[Trajectory]:
    """One trajectory per (row, sample); ``group_id`` = the row, shared by its ``group_size`` samples.
    Rows are numbered from ``first_index`` in the ids (one group of a larger share keeps its id);
    ``limit``: a semaphore shared with other calls (else ``max_concurrency`` episodes at once)."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    sem = limit if limit is not None else asyncio.Semaphore(max_concurrency)
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
            await asyncio.gather(
                *(one(r, i, k) for i, r in enumerate(rows, first_index) for k in range(group_size))
            )
        )
    finally:
        bar.close()
