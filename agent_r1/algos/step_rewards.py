"""Step rewards: the outcome/step reward plus weighted tool-call process rewards, and PSPO's
reward scaling by the running std of discounted returns."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agent_r1.algos.reduce import LocalReducer, Reducer
from agent_r1.algos.segments import segment_ends


class RewardError(ValueError):
    """A reward is NaN/inf or missing; the message names the trajectory."""


def combine_rewards(
    step_reward: torch.Tensor, process_sum: torch.Tensor, process_coef: float = 1.0
) -> torch.Tensor:
    """r_t = step reward (outcome on the terminal step) + process_coef * sum of tool-call rewards."""
    return step_reward + process_coef * process_sum


@dataclass
class RunningReturnStd:
    """VecNormalize-style scaling: r / sqrt(var(G) + eps), G_t = gamma * G_{t-1} + r_t within a
    trajectory. The running moments merge batches (and ranks) with Chan's parallel formula; the
    state is three floats, saved with the trainer state so a resumed run scales identically."""

    gamma: float = 1.0
    eps: float = 1e-8
    count: float = 0.0
    mean: float = 0.0
    m2: float = 0.0

    def forward_returns(self, r: torch.Tensor, traj: torch.Tensor) -> torch.Tensor:
        # forward discounted cumsum within trajectories = reverse scan of the flipped stream
        from agent_r1.algos.segments import reverse_scan

        flipped_seg = traj.flip(0)
        decay = torch.where(segment_ends(flipped_seg), 0.0, self.gamma).to(r.dtype)
        return reverse_scan(r.flip(0), decay).flip(0)

    def scale(self, r: torch.Tensor, traj: torch.Tensor, reducer: Reducer | None = None) -> torch.Tensor:
        reducer = reducer or LocalReducer()
        g = self.forward_returns(r, traj)
        tot = reducer.allreduce_sum(torch.stack([g.new_tensor(float(g.numel())), g.sum()]))
        n_b = float(tot[0])
        if n_b > 0:
            mean_b = float(tot[1]) / n_b
            m2_b = float(reducer.allreduce_sum(((g - mean_b) ** 2).sum().reshape(1))[0])
            n = self.count + n_b
            delta = mean_b - self.mean
            self.mean += delta * n_b / n
            self.m2 += m2_b + delta**2 * self.count * n_b / n
            self.count = n
        var = self.m2 / self.count if self.count > 0 else 0.0
        return r / (var + self.eps) ** 0.5

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, d: dict[str, float]) -> None:
        self.count, self.mean, self.m2 = d["count"], d["mean"], d["m2"]
