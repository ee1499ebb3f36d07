"""One learner measurement in its own process (a dry run patches torch for the whole process):

    python dry_run_worker.py MODE OUT_JSON OVERRIDE...

MODE: ``real`` (gloo, world 1, real CPU tensors under a MemoryTracker), ``dry`` (the dry run of
the same config with the CPU's kernels, ``fused_kernels=False``), ``dry_every`` (the same, each
schedule over every micro-batch rather than the pp + 1 largest), ``plant_cpu_tensor`` (the dry run
with a host tensor added to the policy loss), ``plant_world_gather`` (the dry run with the weight
push gathering every rank's stage over the whole world, as the push did before it went point to
point). Writes the StagePlan (or the error) as JSON.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import sys

import torch


def real(overrides: list[str]) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from agent_r1.launch.plan import StagePlan, measure_update, planned_config
    from agent_r1.learner.backend import cpu_compat
    from agent_r1.learner.backend.dry_run import MemoryTracker
    from agent_r1.train.learner_rank import Learner

    cfg, hf_config, _ = planned_config(overrides)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    cpu_compat.apply()
    ps.initialize_model_parallel(1, 1)
    out = StagePlan(stage=0, rank=0)
    with MemoryTracker("cpu") as memory:
        learner = Learner(cfg)
        measure_update(learner, cfg, hf_config.vocab_size, memory, out)
    return dataclasses.asdict(out)


def planted(overrides: list[str], what: str) -> dict:
    import torch.distributed as dist

    from agent_r1.algos import losses
    from agent_r1.launch.plan import plan_stage
    from agent_r1.learner import actor_steps
    from agent_r1.train import learner_rank as learner

    if what == "plant_cpu_tensor":
        inner = losses.policy_loss

        def policy_loss(name, x, cfg, denom=None):  # a host tensor in the loss path
            loss, m = inner(name, x, cfg, denom=denom)
            return loss + (x.logprobs * torch.ones(x.logprobs.shape)).sum(), m

        actor_steps.policy_loss = policy_loss
    elif what == "plant_world_gather":

        def gather_hf_weights(self):  # every rank's stage gathered to rank 0 over the whole world
            named = dict(self.actor.export_hf())
            parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
            dist.gather_object(named, parts, dst=0)
            return named if dist.get_rank() == 0 else None

        learner.Learner.gather_hf_weights = gather_hf_weights
    return dataclasses.asdict(plan_stage(overrides, 0))


def main() -> None:
    mode, out, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
    try:
        if mode == "real":
            result = real(overrides)
        elif mode in ("dry", "dry_every"):
            from agent_r1.launch.plan import plan_stage

            every = mode == "dry_every"
            result = dataclasses.asdict(plan_stage(overrides, 0, fused_kernels=False, every_microbatch=every))
        else:
            result = planted(overrides, mode)
    except Exception as e:
        from agent_r1.learner.backend.dry_run import describe, where

        result = {"error": describe(e), "where": where(e)}
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
