"""What leaves a learner rank and comes back (a mixin of ``Learner``): the full HF-named weights
gathered to rank 0 for the push (point to point, one tensor at a time), the reward scaler's moments,
and the checkpoint (the actor's, with the critic's beside it)."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("agent_r1.learner")


class LearnerState:
    """``Learner``'s weights out and checkpoints (its actor, critic, process groups, backend)."""

    # ---- weights ---------------------------------------------------------------------------------
    def gather_hf_weights(self) -> dict[str, torch.Tensor] | None:
        """Full HF-named weights on global rank 0, in host memory; None elsewhere. Every tensor
        leaves the GPU as soon as it is made: rank 0's own stage's as its export gathers them (over
        TP, the experts over EP); each later stage's first rank (TP, CP and DP rank 0) streams its tensors to
        rank 0 one at a time, point to point (name, dtype and shape, then the data; a None ends the
        stage). A GPU thus holds one gathered tensor of the push at a time, never a stage's or the
        model's whole HF copy (61 GB for Qwen3-30B-A3B, 470 GB for Qwen3-235B-A22B), and rank 0's
        host memory holds the one model the publisher sends bucket by bucket (and keeps for a
        late server). Every other rank drives its export's collectives."""
        ps = self.ps
        export = self.actor.export_hf()
        rank = dist.get_rank()
        if rank == 0:
            out = {n: self.backend.to_host(t) for n, t in export}
            stages = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
            for src in stages[1:]:
                while True:
                    meta: list[Any] = [None]
                    dist.recv_object_list(meta, src=src)
                    if meta[0] is None:
                        break
                    name, dtype, shape = meta[0]
                    buf = torch.empty(shape, dtype=dtype, device=self.device)
                    dist.recv(buf, src=src)
                    out[name] = self.backend.to_host(buf)
            return out
        sends = (
            ps.get_pipeline_model_parallel_world_size() > 1
            and ps.get_data_parallel_rank() == 0
            and ps.get_tensor_model_parallel_rank() == 0
            and ps.get_context_parallel_rank() == 0
            and 0 in dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
        )
        for name, t in export:
            if sends:
                dist.send_object_list([(name, t.dtype, tuple(t.shape))], dst=0)
                dist.send(t.detach().contiguous(), dst=0)
        if sends:
            dist.send_object_list([None], dst=0)
        return None

    def reward_scaling_state(self) -> dict[str, float] | None:
        """The reward scaler's running moments (kept by the last pipeline stage), on every rank."""
        if self.reward_scaler is None:
            return None
        return self._from_last_stage([self.reward_scaler.state_dict() if self.last_stage else None])[0]

    # ---- checkpoints -----------------------------------------------------------------------------
    def save(self, path, trainer_state: dict[str, Any]) -> None:
        if self.critic is not None:  # first: the actor's directory is what marks a checkpoint complete
            self.critic.save(path.with_name(path.name + ".critic"), {})
        self.actor.save(path, trainer_state)

    def load(self, path) -> dict[str, Any]:
        state = self.actor.load(path)
        if self.critic is not None:
            critic = path.with_name(path.name + ".critic")
            if not (critic / "agent_r1_state.json").exists():
                raise FileNotFoundError(
                    f"checkpoint {path} has no critic ({critic}) but algorithm.critic=true"
                )
            self.critic.load(critic)
            log.info("critic resumed from %s (%d optimizer steps)", critic, self.critic.steps)
        return state
