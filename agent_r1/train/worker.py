"""Rollout worker role: runs agent flows for the coordinator's tasks and commits record shards.

It reads tasks from the run directory, picks the rollout servers that already have the task's
weight version, runs its share of the episodes through the same ``RolloutClient`` that drives
SGLang, optionally scores every action under the teacher (OPD), and commits one shard per task.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pyarrow as pa

from agent_r1.errors import RoleTimeout
from agent_r1.train.config import TrainConfig
from agent_r1.train.metrics import episode_stats
from agent_r1.train.run_dir import RunDir
from agent_r1.train.run_services import run_services
from agent_r1.train.tasks import RolloutTask, acknowledge, pending_tasks

log = logging.getLogger("agent_r1.worker")


async def servers_with_version(
    urls_fn, version: int, timeout_s: float, api_key: str | None = None, api: str = "embedded"
) -> list[str]:
    """Servers (re-discovered while waiting) that answer and have at least ``version``."""
    from agent_r1.rollout.client import server_versions

    deadline = time.time() + timeout_s
    while True:
        urls = urls_fn()
        ok = [u for u, v in (await server_versions(urls, api_key, api)).items() if v >= version]
        if ok:
            return ok
        if time.time() > deadline:
            raise RoleTimeout(
                f"no rollout server with weight version >= {version} within {timeout_s:.0f} s: {urls}"
            )
        await asyncio.sleep(0.2)


async def teacher_logprobs(client: Any, trajs: list[Any]) -> list[list[float]]:
    """log pi_teacher of every action token given its observation (one prefill per step).
    Scoring starts one token early: SGLang answers the first position of ``logprob_start_len``
    with ``null`` (no logprob computed for it), so that position is the observation's last token
    and only the action's logprobs are kept."""

    async def one(step) -> list[float]:
        n = len(step.action_token_ids)
        body = {
            "input_ids": list(step.obs_token_ids) + list(step.action_token_ids),
            "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
            "return_logprob": True,
            "logprob_start_len": max(len(step.obs_token_ids) - 1, 0),
        }
        out = await client.generate_raw(body, session=step.trajectory_id)
        got = out["meta_info"]["input_token_logprobs"][-n:] if n else []
        if any(x[0] is None for x in got):
            raise RuntimeError(
                f"teacher returned no logprob for an action token ({step.trajectory_id} step "
                f"{step.step_index}): {got[:3]}"
            )
        lps = [float(x[0]) for x in got]
        if len(lps) != n:
            raise RuntimeError(
                f"teacher returned {len(lps)} logprobs for {len(step.action_token_ids)} action tokens "
                f"({step.trajectory_id} step {step.step_index})"
            )
        return lps

    return list(await asyncio.gather(*(one(s) for t in trajs for s in t.steps)))


def drop_env_errors(name: str, trajs: list[Any]) -> tuple[list[Any], list[Any]]:
    """(the trajectories to keep, those whose environment died under them: counted, never
    trained on)."""
    errored = [t for t in trajs if t.metrics.get("env_error")]
    if errored:
        log.warning(
            "%s: %d of %d episodes ended on an environment error and are dropped (first: %s)",
            name, len(errored), len(trajs), errored[0].steps[-1].info["env_error"],
        )  # fmt: skip
    return [t for t in trajs if not t.metrics.get("env_error")], errored


def generated(trajs: list[Any]) -> dict[str, float]:
    """Every episode generated, those an environment error keeps from training included: the
    length-bias check compares the trained ones against them."""
    return {
        "generated_episodes": float(len(trajs)),
        "generated_steps": float(sum(len(t.steps) for t in trajs)),
    }


class Worker:
    MAX_ATTEMPTS = 5  # a share whose servers all died is run again (nothing of it was committed)

    def __init__(self, cfg: TrainConfig, rd: RunDir, index: int):

        from agent_r1.agent.chat import ChatCodec
        from recipes import load_all, load_recipe

        load_all()
        self.cfg, self.rd, self.index = cfg, rd, index
        self.recipe = load_recipe(cfg.recipe.name)
        self.codec = ChatCodec.load(cfg.model.path)
        self._rows: dict[str, list[Any]] = {}
        self.api_key = rd.api_key()
        self.services = run_services(cfg, rd)  # what its episodes use besides the policy
        self._episodes_done: dict[str, int] = {}  # episodes finished per task (its progress file)

    def rows(self, split: str) -> list[Any]:
        if split not in self._rows:
            from agent_r1.train.splits import split_rows

            self._rows[split] = split_rows(self.cfg, split)
        return self._rows[split]

    def serve_forever(self, poll_s: float = 0.05) -> None:
        log.info("worker %d ready (run dir %s)", self.index, self.rd.root)
        if self.cfg.rollout.mode == "stream":
            asyncio.run(self._stream(poll_s))
            return
        while not self.rd.stopping:
            tasks = pending_tasks(self.rd, self.index)
            if not tasks:
                time.sleep(poll_s)
                continue
            for task in tasks:
                if self.rd.stopping:
                    break
                acknowledge(self.rd, task, self.index, asyncio.run(self.run_task(task)))
        log.info("worker %d: stop requested", self.index)

    async def _stream(self, poll_s: float) -> None:
        """Streaming: every pending task runs at once (the coordinator issues at most
        ``max_staleness`` ahead: that is the admission), its episodes sharing one limit of
        ``rollout.max_concurrency`` (older tasks queued first); a task is acknowledged once all of
        its groups are committed. A failure stops the worker (the launcher restarts it; committed
        groups are reused)."""
        limit = asyncio.Semaphore(self.cfg.rollout.max_concurrency)
        running: dict[str, asyncio.Task] = {}

        async def run_and_acknowledge(task: RolloutTask) -> None:
            acknowledge(self.rd, task, self.index, await self.run_task(task, limit))

        try:
            while not self.rd.stopping:
                for task in pending_tasks(self.rd, self.index):
                    if task.name not in running:
                        running[task.name] = asyncio.create_task(run_and_acknowledge(task))
                for name, t in list(running.items()):
                    if t.done():
                        del running[name]
                        t.result()  # a failure propagates
                await asyncio.sleep(poll_s)
        finally:
            for t in running.values():
                t.cancel()
            await asyncio.gather(*running.values(), return_exceptions=True)
        log.info("worker %d: stop requested", self.index)

    async def run_task(self, task: RolloutTask, limit: asyncio.Semaphore | None = None) -> dict[str, Any]:
        """This worker's share of a task: episodes → (teacher logprobs) → one committed shard, or
        one per group (``task.shards == "group"``) as each group finishes."""
        from agent_r1.records.schema import records_to_table
        from agent_r1.records.shard import committed_shards, shard_name, write_shard

        if task.shards == "group":
            return await self._run_groups(task, limit)
        out_dir = self.rd.root / task.records_subdir
        done = [m for m in committed_shards(out_dir, task.iteration) if m.name == shard_name(self.index)]
        if done:  # committed before a restart: never generate (or train) a record twice
            log.info("%s: shard already committed (%d rows), acknowledging", task.name, done[0].rows)
            return {"reused": True, "rows": done[0].rows}
        t0 = time.time()
        trajs = await self._episodes(task)
        gen_s = time.time() - t0
        trajs, errored = drop_env_errors(task.name, trajs)
        table = records_to_table([s for t in trajs for s in t.steps])
        if task.teacher:
            table = await self._with_teacher_logprobs(table, trajs)
        meta = write_shard(out_dir, task.iteration, self.index, table)
        metrics = episode_stats(trajs)
        metrics.update(
            rows=meta.rows, generate_s=gen_s, total_s=time.time() - t0, env_errors=float(len(errored))
        )
        metrics.update(generated(trajs + errored))
        log.info(
            "%s: %d episodes, success %.3f, %d rows, %.1f s",
            task.name,
            len(trajs),
            metrics["success"] / max(len(trajs), 1),
            meta.rows,
            metrics["total_s"],
        )
        return metrics

    async def _run_groups(self, task: RolloutTask, limit: asyncio.Semaphore | None) -> dict[str, Any]:
        """This worker's share, each group (a prompt and its ``group_size`` samples) committed as
        its own shard the moment its last episode ends. Groups committed before a restart are
        reused, never generated or trained twice; those that were in flight are issued again
        (counted in the log). A group is committed whole or not at all."""
        from agent_r1.records.schema import records_to_table
        from agent_r1.records.shard import committed_shards, shard_name, write_shard

        out_dir = self.rd.root / task.records_subdir
        committed = {m.name for m in committed_shards(out_dir, task.iteration)}
        share = list(enumerate(task.share(self.index)))  # (index in the share, (position, row))
        todo = [(j, pos, r) for j, (pos, r) in share if shard_name(f"g{pos:06d}") not in committed]
        if len(todo) < len(share):
            log.info(
                "%s: %d of %d groups already committed (reused); %d issued again",
                task.name, len(share) - len(todo), len(share), len(todo),
            )  # fmt: skip
        t0 = time.time()

        async def group(j: int, pos: int, r: int) -> tuple[list[Any], list[Any], int]:
            trajs, errored = drop_env_errors(task.name, await self._episodes(task, [(j, r)], limit))
            table = records_to_table([s for t in trajs for s in t.steps])
            if task.teacher:
                table = await self._with_teacher_logprobs(table, trajs)
            return trajs, errored, write_shard(out_dir, task.iteration, f"g{pos:06d}", table).rows

        done = await asyncio.gather(*(group(*g) for g in todo))
        trajs = [t for ts, _, _ in done for t in ts]
        metrics = episode_stats(trajs)
        metrics.update(
            rows=sum(n for _, _, n in done),
            generate_s=time.time() - t0,
            total_s=time.time() - t0,
            env_errors=float(sum(len(e) for _, e, _ in done)),
            reused=not todo,
            reused_groups=len(share) - len(todo),
        )
        metrics.update(generated(trajs + [t for _, e, _ in done for t in e]))
        log.info(
            "%s: %d groups (%d episodes), success %.3f, %d rows, %.1f s",
            task.name, len(todo), len(trajs), metrics["success"] / max(len(trajs), 1), metrics["rows"],
            metrics["total_s"],
        )  # fmt: skip
        return metrics

    async def _episodes(
        self,
        task: RolloutTask,
        share: list[tuple[int, int]] | None = None,
        limit: asyncio.Semaphore | None = None,
    ) -> list[Any]:
        """Run this worker's rows of ``task`` (or ``share``: (index in the worker's share, row)
        pairs, e.g. one group) on servers holding its weight version; when every server it had
        dies, run them again on the live ones (nothing was committed)."""
        from agent_r1.agent.run_episodes import run_episodes
        from agent_r1.http_service import follow_published, published_urls
        from agent_r1.rollout.client import RolloutClient, RolloutError

        rc = self.cfg.rollout
        if share is None:
            share = list(enumerate(r for _, r in task.share(self.index)))
        rows = [self.rows(task.split)[r] for _, r in share]
        flow = task.episode.flow(task.seed)
        progress = self.rd.tasks / f"{task.name}.w{self.index}.progress"
        last = [0.0]

        def on_episode(n: int) -> None:
            count = self._episodes_done[task.name] = self._episodes_done.get(task.name, 0) + 1
            if time.time() - last[0] > 0.5:
                progress.write_text(str(count))
                last[0] = time.time()

        for attempt in range(1, self.MAX_ATTEMPTS + 1):
            servers = await servers_with_version(
                lambda: published_urls(self.rd.servers),
                task.weight_version,
                self.cfg.trainer.timeout_s,
                self.api_key,
                rc.engine,
            )
            router = (
                follow_published(self.rd.router_file, rc.ready_timeout_s, "router")() if rc.router else None
            )
            client = RolloutClient(
                servers=None if router else servers,
                router=router,
                timeout_s=rc.request_timeout_s,
                api_key=self.api_key,
                api=rc.engine,
                interrupt_tokens=rc.interrupt_tokens,  # an action a weight push interrupted is resent
            )
            try:
                return await run_episodes(
                    rows,
                    client,
                    self.codec,
                    flow,
                    task.group_size,
                    id_prefix=f"{task.name}-w{self.index}",
                    max_concurrency=rc.max_concurrency,
                    progress=False,
                    on_episode=on_episode,
                    services=self.services,
                    first_index=share[0][0] if len(share) == 1 else 0,
                    limit=limit,
                )
            except RolloutError as e:
                if attempt == self.MAX_ATTEMPTS:
                    raise
                log.warning(
                    "%s: servers failed (%s); running the share again on the live servers (%d/%d)",
                    task.name,
                    e,
                    attempt,
                    self.MAX_ATTEMPTS,
                )
            finally:
                await client.close()
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def _with_teacher_logprobs(self, table: pa.Table, trajs: list[Any]) -> pa.Table:
        """``table`` with the OPD teacher's logprobs of every sampled action token as a column."""
        from agent_r1.http_service import published_urls
        from agent_r1.records.schema import EXTRA_FIELDS
        from agent_r1.rollout.client import RolloutClient

        teachers = published_urls(self.rd.teachers)
        client = RolloutClient(
            servers=teachers, timeout_s=self.cfg.rollout.request_timeout_s, api_key=self.api_key
        )
        try:
            lps = await teacher_logprobs(client, trajs)
        finally:
            await client.close()
        field = EXTRA_FIELDS["teacher_logprobs"]
        return table.append_column(field, pa.array(lps, field.type))
