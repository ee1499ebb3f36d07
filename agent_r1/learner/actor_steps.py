"""The policy's forward-backward passes (a mixin of ``Actor``): this rank's micro-batches through
Megatron's pipeline schedules, the logprobs of a batch (no gradient), and a training step of the
configured loss over mini-batches."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from agent_r1.algos.losses import LossConfig, LossInputs, loss_config, policy_loss
from agent_r1.learner.context_parallel import gather_rows
from agent_r1.learner.forward import packed_forward
from agent_r1.learner.logprobs import aligned, packed_logprobs
from agent_r1.learner.optim import pad_multiple
from agent_r1.learner.packing import Packed


@dataclass
class PolicyTargets:
    """Flat per-action-token (A,) tensors of a ``LearnerBatch`` on the learner's device: what the
    policy loss reads at each micro-batch's ``act_index``."""

    advantages: torch.Tensor  # float32, a step's advantage broadcast over its tokens (or per token)
    old_logprobs: torch.Tensor | None = None  # None: on-policy, this forward's own (detached)
    ref_logprobs: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None  # as sampled (mismatch metric / TIS)
    teacher_logprobs: torch.Tensor | None = None  # OPD


class ActorSteps:
    """``Actor``'s schedules and steps (its chunks, optimizer, backend and configs)."""

    def _rows(self, mb: Packed) -> torch.Tensor:
        """The stream positions whose output the loss reads: the logits before each action token
        (under context parallelism: those of this CP rank's rows)."""
        return mb.label_rows if mb.cp is None else mb.cp.label_rows

    def _shard(self, micro: list[Packed]) -> list[Packed]:
        """Under context parallelism, this CP rank's share of each micro-batch."""
        from megatron.core import parallel_state as ps

        from agent_r1.learner.context_parallel import shard

        cp = ps.get_context_parallel_world_size()
        if cp == 1:
            return micro
        b = self.bridge  # each rank's stream padded as a whole one would be (SP's tp, FP8's 16)
        align = pad_multiple(self.optim_cfg, b.precision, b.tp if b.sp else 1)
        rank, group = ps.get_context_parallel_rank(), ps.get_context_parallel_group()
        return [shard(mb, cp, rank, group, align) for mb in micro]

    def _run(self, micro: list[Packed], loss_fn, forward_only: bool, select_rows: bool = True) -> None:
        """Megatron's forward-backward schedule over the micro-batches; ``loss_fn(mb, output)``
        runs on the last pipeline stage with the output at ``self._rows(mb)`` ((rows, V/tp)
        logits, (rows, 1) values), or at every position (of this CP rank's stream) without
        ``select_rows``."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        micro = self.backend.schedule(self._shard(micro))  # every one, except in agent-r1 plan's dry run
        # the interleaved schedule (virtual stages) walks the micro-batches once per chunk
        data = [iter(micro) for _ in self.chunks] if len(self.chunks) > 1 else iter(micro)
        last = {id(c): m.post_process for c, m in zip(self.chunks, self.modules, strict=True)}

        def step(data_iterator, model):
            mb = next(data_iterator)
            out = packed_forward(
                model, mb, self._rows(mb) if select_rows else None, fused_plan=self.backend.fused_plan
            )
            if last[id(model)]:
                out = out.unsqueeze(0)
            return out, lambda output: loss_fn(mb, output.squeeze(0))

        get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=data,
            model=self.chunks,
            num_microbatches=len(micro),
            seq_length=max(mb.num_tokens for mb in micro),
            micro_batch_size=1,
            forward_only=forward_only,
        )

    def _update(self, micro: list[Packed], loss_fn, select_rows: bool = True) -> dict[str, float]:
        """Forward/backward over all micro-batches, one optimizer and LR step; grad norm and lr."""
        self._each("train")
        self._each("zero_grad_buffer")
        self.optimizer.zero_grad()
        self._run(micro, loss_fn, forward_only=False, select_rows=select_rows)
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise FloatingPointError(
                f"{type(self).__name__} optimizer step {self.steps} skipped (non-finite gradients)"
            )
        self.scheduler.step(increment=1)
        self.steps += 1
        return {"grad_norm": float(grad_norm or 0.0), "lr": float(self.optimizer.param_groups[0]["lr"])}

    def _logprobs(
        self, mb: Packed, logits: torch.Tensor, align: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each action token's logprob and entropy from the output ``logits``; with a
        ``logprob_values`` source (``trainer.deterministic``) and ``align``, the logprobs' values
        are its, their gradients these logits' (``logprobs.aligned``)."""
        from megatron.core import parallel_state as ps

        group, rank = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()
        cp = mb.cp
        targets = mb.tokens[mb.label_pos] if cp is None else cp.targets[cp.label_idx[cp.rank]]
        lp, ent = packed_logprobs(
            logits,
            targets,
            group,
            rank * logits.shape[-1],
            self.lm_config.vocab_size,
            temperature=self.temperature,
        )
        if cp is not None:  # every CP rank's labels: the micro-batch's whole vectors
            lp, ent = gather_rows(lp, cp), gather_rows(ent, cp)
        if align and self.logprob_values is not None:
            lp = aligned(lp, self._exact_logprobs(mb))
        return lp, ent

    def _exact_logprobs(self, mb: Packed) -> torch.Tensor:
        """``logprob_values``' logprobs of ``mb`` under the current weights (sent once per step)."""
        src = self.logprob_values
        if mb.positions.dim() != 1 or mb.cp is not None or mb.images:
            raise ValueError("exact logprobs (trainer.deterministic) take text micro-batches without CP")
        for (a, e), (_, shared) in zip(mb.bounds, mb.parents or [(0, 0)] * len(mb.bounds), strict=True):
            if int(mb.positions[a]) != shared:  # the engine prefills every sequence from position 0
                raise ValueError(f"the packed sequence at rows {a}..{e} does not start at position {shared}")
        if src.version != self.steps:
            src.load(self.export_hf(), self.steps)
        return src.logprobs(*mb.unshared()).to(self.device)

    # ---- API --------------------------------------------------------------------------------------------
    @torch.no_grad()
    def logprobs(self, micro: list[Packed], num_tokens: int) -> torch.Tensor | None:
        """(num_tokens,) float32 logprobs of the micro-batches' action tokens at their ``act_index``
        (NaN elsewhere) on the last pipeline stage; None on the others."""
        from megatron.core import parallel_state as ps

        out = torch.full((num_tokens,), float("nan"), device=self.device)

        def loss_fn(mb, logits):
            lp, _ = self._logprobs(mb, logits)
            out[mb.act_index] = lp
            return lp.sum() * 0.0, {}

        self._each("eval")
        if micro:
            self._run(micro, loss_fn, forward_only=True)
        return out if ps.is_pipeline_last_stage() else None

    def train_step(
        self,
        micro: list[Packed],
        targets: PolicyTargets | None,
        loss_name: str = "ppo",
        loss_cfg: LossConfig | None = None,
        denom: float | None = None,
    ) -> tuple[dict[str, float], torch.Tensor | None]:
        """``_train_step``, its torch thread count chosen by the governor on a CPU (1 or the
        process's threads, from measured step times: ``cpus.ThreadGovernor``)."""
        gov = self.governor
        if gov is None:
            return self._train_step(micro, targets, loss_name, loss_cfg, denom)
        gov.pick()
        t0 = time.perf_counter()
        out = self._train_step(micro, targets, loss_name, loss_cfg, denom)
        gov.record(time.perf_counter() - t0, sum(int(mb.tokens.numel()) for mb in micro))
        return out

    def _train_step(
        self,
        micro: list[Packed],
        targets: PolicyTargets | None,
        loss_name: str = "ppo",
        loss_cfg: LossConfig | None = None,
        denom: float | None = None,
    ) -> tuple[dict[str, float], torch.Tensor | None]:
        """One optimizer step over the micro-batches (gradients accumulated). ``targets`` (flat
        over the batch; None on stages before the last) supply advantages and reference logprobs;
        ``denom`` is this rank's share of the loss denominator (see ``Learner.update``).

        Returns the metrics (grad norm and lr on every stage) and, on the last stage, the
        detached logprobs this forward computed (flat, NaN outside the micro-batches). Aborts
        before the update on a non-finite loss, naming the step."""
        from megatron.core import parallel_state as ps

        cfg = loss_cfg or loss_config(loss_name)
        last = ps.is_pipeline_last_stage()
        metrics: dict[str, float] = {}
        nmb = len(micro)
        seen = None
        if last:
            seen = torch.full_like(targets.advantages, float("nan"))

        def loss_fn(mb, logits):
            # the warm start's NLL reads no ratio: its values need not be the engine's
            lp, ent = self._logprobs(mb, logits, align=loss_name != "sft")
            idx = mb.act_index
            seen[idx] = lp.detach()

            def pick(x: torch.Tensor | None) -> torch.Tensor | None:
                return None if x is None else x[idx]

            old = targets.old_logprobs
            x = LossInputs(
                lp,
                lp.detach() if old is None else old[idx],
                targets.advantages[idx],
                mb.label_mask,
                mb.label_step,
                mb.num_steps,
                ref_logprobs=pick(targets.ref_logprobs),
                rollout_logprobs=pick(targets.rollout_logprobs),
                entropy=ent,
                teacher_logprobs=pick(targets.teacher_logprobs),
            )
            loss, m = policy_loss(loss_name, x, cfg, denom=denom)
            if not torch.isfinite(loss):
                raise FloatingPointError(
                    f"non-finite loss at learner step {self.steps} "
                    f"(micro-batch of trajectories {mb.trajectories.tolist()})"
                )
            for k, v in m.items():  # loss/* are shares of the total, the rest means over micro-batches
                metrics[k] = metrics.get(k, 0.0) + (v if k.startswith("loss/") else v / nmb)
            # the schedule divides by the number of micro-batches; our loss is already a share of the total
            return loss * nmb, {}

        metrics.update(self._update(micro, loss_fn))
        if not last:
            return {"grad_norm": metrics["grad_norm"], "lr": metrics["lr"]}, None
        return metrics, seen
