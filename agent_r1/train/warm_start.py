"""The warm start (a mixin of ``Trainer``): the recipe's demonstrator writes demonstration records
once (``sft_records/``), every learner rank imitates them for ``sft.steps`` steps, and the run's
policy version moves to 1; its losses go to TensorBoard's ``sft`` run. A stop request during it
ends the run before anything is checkpointed."""

from __future__ import annotations

import logging
import time

import torch.distributed as dist

from agent_r1.records.schema import records_to_table
from agent_r1.records.shard import finalize_iteration, write_shard
from agent_r1.train.metrics import Reporter
from agent_r1.train.sft import demonstration_records
from agent_r1.train.tasks import StopRequested

log = logging.getLogger("agent_r1.train")


class WarmStart:
    """``Trainer``'s warm start (its config, run directory, learner, codec and state)."""

    def warm_start(self) -> None:
        c = self.cfg.sft
        if self.state["sft_done"] or c.steps == 0:
            return
        t0 = time.time()
        sft_dir = self.rd.root / "sft_records"
        if self.rank == 0 and not (sft_dir / "iter_000000" / "manifest.json").exists():
            self._write_demonstrations(sft_dir)
        dist.barrier()
        demos = self.learner.batch(self.learner.read(sft_dir, 0))
        losses = self.learner.sft(
            demos,
            c.steps,
            c.batch_trajectories,
            c.seed,
            self.cfg.trainer.progress and self.rank == 0,
            stop=lambda: self.any_rank(self.stop_requested()),
        )
        if losses is None:
            raise StopRequested("warm start")
        self.state["sft_done"] = True
        self.state["version"] += 1
        if self.rank == 0 and losses:  # its own TensorBoard run: its steps are SFT steps
            sft_log = Reporter(str(self.rd.tensorboard / "sft"))
            for i in range(0, len(losses), max(1, len(losses) // 100)):
                sft_log.scalars({"sft/nll": losses[i]}, i)
            sft_log.close()
            log.info(
                "warm start: %d SFT steps, nll %.3f -> %.3f (%.0f s)",
                c.steps,
                losses[0],
                losses[-1],
                time.time() - t0,
            )

    def _write_demonstrations(self, sft_dir) -> None:
        from recipes import load_all, load_recipe

        load_all()
        from agent_r1.train.run_services import run_services
        from agent_r1.train.splits import split_rows

        recipe = load_recipe(self.cfg.recipe.name)
        rows = split_rows(self.cfg, "train")
        rows = (rows * (self.cfg.sft.demos // len(rows) + 1))[: self.cfg.sft.demos]
        flow = self.cfg.episode.flow()
        trajs = demonstration_records(
            recipe, rows, self.codec, flow, self.cfg.sft.seed,
            services=run_services(self.cfg, self.rd),  # search, judges and shops like the policy will
            **self.cfg.sft.options,
        )  # fmt: skip
        table = records_to_table([s for t in trajs for s in t.steps])
        write_shard(sft_dir, 0, 0, table)
        finalize_iteration(sft_dir, 0)
        ok = sum(t.metrics.get("success", 0.0) for t in trajs) / max(len(trajs), 1)
        missteps = sum(not any(s.action_mask) for t in trajs for s in t.steps)
        log.info(
            "warm start data: %d demonstrations (%d steps, %d missteps not imitated), demonstrator success %.2f",
            len(trajs),
            table.num_rows,
            missteps,
            ok,
        )
