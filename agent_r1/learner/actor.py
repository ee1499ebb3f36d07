"""The policy learner: a Megatron-Core GPTModel stage (built by megatron_bridge), wrapped in
Megatron DDP with the distributed optimizer, trained through Megatron's pipeline schedules on
prefix-merged packed micro-batches with the losses of ``agent_r1.algos.losses``.

Every rank of the model-parallel group calls the same methods with the same trajectories; data
parallel ranks call them with their own trajectories (gradients are averaged by DDP).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from agent_r1.algos.losses import POLICY_LOSSES, LossConfig, LossInputs, loss_config, policy_loss
from agent_r1.learner.packing import Packed, pack_micro_batches
from agent_r1.learner.policy import packed_forward, packed_logprobs


@dataclass
class OptimConfig:
    lr: float = 1e-5
    min_lr: float = 0.0
    warmup_steps: int = 0
    decay_steps: int = 1000  # lr decays (cosine) to min_lr over this many optimizer steps
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    micro_tokens: int = 4096  # packed tokens per micro-batch
    distributed_optimizer: bool = True

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"optim.lr must be > 0 and 0 <= min_lr <= lr, got {self.lr}, {self.min_lr}")
        if self.micro_tokens < 1:
            raise ValueError(f"optim.micro_tokens must be >= 1, got {self.micro_tokens}")


@dataclass
class StepBatchForLearner:
    """What one training step consumes: trajectories of step dicts (obs, action, prefix_len, mask)
    and, per step in the same order, per-token old logprobs and the step's advantage."""

    trajectories: list[list[dict]]
    old_logprobs: list[list[float]]  # per step, per action token
    advantages: list[float]  # per step
    ref_logprobs: list[list[float]] | None = None
    rollout_logprobs: list[list[float]] | None = None  # as sampled (mismatch metric / TIS)
    teacher_logprobs: list[list[float]] | None = None  # OPD
    token_advantages: list[list[float]] | None = None  # token-level estimators (replaces ``advantages``)
    extra: dict[str, Any] = field(default_factory=dict)


class Actor:
    def __init__(
        self,
        hf_dir: str | Path,
        bridge: Any,
        optim: OptimConfig,
        seed: int = 0,
        value_head: bool = False,
        trainable: bool = True,
    ):
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from safetensors.torch import load_file
        from transformers import AutoConfig

        from megatron_bridge import build_gpt_model, load_hf_weights

        self.hf_dir, self.bridge, self.optim_cfg = Path(hf_dir), bridge, optim
        self.hf_config = AutoConfig.from_pretrained(self.hf_dir)
        model_parallel_cuda_manual_seed(seed)
        state = {}
        for f in sorted(self.hf_dir.glob("*.safetensors")):
            state.update(load_file(str(f)))
        if value_head:  # the critic: untied backbone, scalar head instead of the vocabulary
            import copy

            self.hf_config = copy.deepcopy(self.hf_config)
            if getattr(self.hf_config, "tie_word_embeddings", False):
                self.hf_config.tie_word_embeddings = False
                state["lm_head.weight"] = state["model.embed_tokens.weight"]
        module = build_gpt_model(self.hf_config, bridge)
        load_hf_weights(module, state, self.hf_config)
        if value_head:
            from megatron.core import parallel_state as ps

            from agent_r1.learner.critic import ValueHead

            if ps.is_pipeline_last_stage():
                module.output_layer = ValueHead(self.hf_config.hidden_size, module.config.params_dtype)
        cfg = module.config
        self.trainable = trainable
        if not trainable:  # a frozen reference policy: no DDP, no optimizer
            for p in module.parameters():
                p.requires_grad_(False)
            self.model, self.optimizer, self.scheduler, self.steps = module, None, None, 0
            return
        ddp = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=optim.distributed_optimizer
        )
        self.model = DistributedDataParallel(cfg, ddp, module)
        cfg.finalize_model_grads_func = finalize_model_grads
        cfg.no_sync_func = self.model.no_sync
        cfg.grad_sync_func = self.model.start_grad_sync
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=optim.lr,
                min_lr=optim.min_lr,
                weight_decay=optim.weight_decay,
                clip_grad=optim.clip_grad,
                adam_beta1=optim.adam_beta1,
                adam_beta2=optim.adam_beta2,
                use_distributed_optimizer=optim.distributed_optimizer,
                params_dtype=cfg.params_dtype,
                bf16=cfg.bf16,
            ),
            [self.model],
        )
        self.scheduler = self.make_scheduler(optim)
        self.steps = 0

    def make_scheduler(self, optim: OptimConfig) -> Any:
        """Warmup + cosine decay of ``optim``'s lr (also used to run a phase, e.g. the warm start,
        at its own learning rate: assign the result to ``self.scheduler``)."""
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        for group in self.optimizer.param_groups:  # megatron keeps the bounds per parameter group
            group["max_lr"], group["min_lr"] = optim.lr, optim.min_lr
        return OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0 if optim.warmup_steps else optim.lr,
            max_lr=optim.lr,
            min_lr=optim.min_lr,
            lr_warmup_steps=optim.warmup_steps,
            lr_decay_steps=max(optim.decay_steps, optim.warmup_steps + 1),
            lr_decay_style="cosine",
            start_wd=optim.weight_decay,
            end_wd=optim.weight_decay,
            wd_incr_steps=1,
            wd_incr_style="constant",
        )

    # ---- helpers ------------------------------------------------------------------------------------
    @property
    def module(self) -> Any:
        return self.model.module if self.trainable else self.model

    def _tp(self) -> tuple[Any, int]:
        from megatron.core import parallel_state as ps

        return ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()

    def _run(self, micro: list[tuple[list[int], Packed]], loss_fn, forward_only: bool) -> None:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        data = iter(micro)

        def step(data_iterator, model):
            members, mb = next(data_iterator)
            out = packed_forward(model, mb)
            from megatron.core import parallel_state as ps

            if ps.is_pipeline_last_stage():
                out = out.unsqueeze(0)
            return out, lambda output: loss_fn(members, mb, output[0])

        get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=data,
            model=[self.model],
            num_microbatches=len(micro),
            seq_length=max(mb.num_tokens for _, mb in micro),
            micro_batch_size=1,
            forward_only=forward_only,
        )

    def _update(self, micro: list[tuple[list[int], Packed]], loss_fn) -> dict[str, float]:
        """Forward/backward over all micro-batches, one optimizer and LR step; grad norm and lr."""
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._run(micro, loss_fn, forward_only=False)
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise FloatingPointError(
                f"{type(self).__name__} optimizer step {self.steps} skipped (non-finite gradients)"
            )
        self.scheduler.step(increment=1)
        self.steps += 1
        return {"grad_norm": float(grad_norm or 0.0), "lr": float(self.optimizer.param_groups[0]["lr"])}

    # ---- API --------------------------------------------------------------------------------------------
    @torch.no_grad()
    def logprobs(self, trajectories: list[list[dict]]) -> list[list[float]] | None:
        """Per-step action-token logprobs (last pipeline stage; None elsewhere)."""
        micro = pack_micro_batches(trajectories, self.optim_cfg.micro_tokens)
        group, tp_rank = self._tp()
        starts = _step_offsets(trajectories)
        result: dict[int, list[float]] = {}

        def loss_fn(members, mb, logits):
            lp, _ = packed_logprobs(logits, mb, group, tp_rank * logits.shape[-1], self.hf_config.vocab_size)
            rows = _global_rows(members, trajectories, starts)
            for row, step_lp in _split_by_step(lp, mb, rows).items():
                result[row] = step_lp
            return lp.sum() * 0.0, {}

        self.model.eval()
        self._run(micro, loss_fn, forward_only=True)
        from megatron.core import parallel_state as ps

        if not ps.is_pipeline_last_stage():
            return None
        return [result[i] for i in range(len(result))]

    def train_step(
        self, batch: StepBatchForLearner, loss_name: str = "ppo", loss_cfg: LossConfig | None = None
    ) -> dict[str, float]:
        """One optimizer step over the batch (all micro-batches accumulated). Returns metrics on the
        last pipeline stage (grad norm and lr everywhere). Aborts before the update on a non-finite
        loss, naming the step."""
        from megatron.core import parallel_state as ps

        cfg = loss_cfg or loss_config(loss_name)
        micro = pack_micro_batches(batch.trajectories, self.optim_cfg.micro_tokens)
        group, tp_rank = self._tp()
        starts = _step_offsets(batch.trajectories)
        n_tokens = sum(len(s["action"]) for t in batch.trajectories for s in t)
        n_steps = sum(len(t) for t in batch.trajectories)
        metrics: dict[str, float] = {}
        nmb = len(micro)

        def loss_fn(members, mb, logits):
            lp, ent = packed_logprobs(
                logits, mb, group, tp_rank * logits.shape[-1], self.hf_config.vocab_size
            )
            rows = _global_rows(members, batch.trajectories, starts)
            step_row = rows[mb.label_step]

            def per_token(lists):
                if lists is None:
                    return None
                return torch.cat([torch.tensor(lists[r], dtype=torch.float32) for r in rows.tolist()])

            old = per_token(batch.old_logprobs)
            if batch.token_advantages is not None:
                adv = per_token(batch.token_advantages)
            else:
                adv = torch.tensor(batch.advantages, dtype=torch.float32)[step_row]
            x = LossInputs(
                lp,
                old,
                adv,
                mb.label_mask,
                mb.label_step,
                mb.num_steps,
                ref_logprobs=per_token(batch.ref_logprobs),
                rollout_logprobs=per_token(batch.rollout_logprobs),
                entropy=ent,
                teacher_logprobs=per_token(batch.teacher_logprobs),
            )
            agg = POLICY_LOSSES.get(loss_name).agg or cfg.agg
            denom = float(n_tokens) if agg == "token-mean" else float(n_steps)
            loss, m = policy_loss(loss_name, x, cfg, denom=denom)
            if not torch.isfinite(loss):
                raise FloatingPointError(
                    f"non-finite loss at learner step {self.steps} (micro-batch of trajectories {members})"
                )
            for k, v in m.items():
                metrics[k] = (
                    metrics.get(k, 0.0) + v / nmb if not k.startswith("loss/") else metrics.get(k, 0.0) + v
                )
            # the schedule divides by the number of micro-batches; our loss is already a share of the total
            return loss * nmb, {}

        metrics.update(self._update(micro, loss_fn))
        if not ps.is_pipeline_last_stage():
            return {"grad_norm": metrics["grad_norm"], "lr": metrics["lr"]}
        return metrics

    def export_hf(self):
        """HF-named full tensors of this rank's stage (for weight sync / HF checkpoints)."""
        from megatron_bridge import export_hf_weights

        return export_hf_weights(self.module, self.hf_config)

    # ---- checkpoints --------------------------------------------------------------------------------------
    def save(
        self, path: str | Path, trainer_state: dict[str, Any] | None = None, with_optimizer: bool = True
    ) -> None:
        """dist_checkpointing (torch_dist) of the model (+ optimizer, DP-reshardable), trainer state
        beside it; written to ``path.tmp`` and renamed, so a crash never leaves a half checkpoint."""
        import torch.distributed as dist
        from megatron.core import dist_checkpointing

        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        model_sd = self.module.sharded_state_dict()
        state = {"model": model_sd}
        if with_optimizer and self.optimizer is not None:
            state["optimizer"] = self.optimizer.sharded_state_dict(
                model_sd, metadata={"distrib_optim_sharding_type": "dp_reshardable"}
            )
        dist_checkpointing.save(state, str(tmp))
        dist.barrier()
        if dist.get_rank() == 0:
            meta = {
                "steps": self.steps,
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                "with_optimizer": with_optimizer and self.optimizer is not None,
                "tp": self.bridge.tp,
                "pp": self.bridge.pp,
                "trainer": trainer_state or {},
            }
            (tmp / "agent_r1_state.json").write_text(json.dumps(meta, indent=1))
            if path.exists():
                shutil.rmtree(path)
            os.replace(tmp, path)
        dist.barrier()

    def _init_optimizer_state(self) -> None:
        """A never-stepped torch Adam has no state; the checkpoint format expects moments and a
        step per parameter, so create empty ones before loading into them."""
        for opt in _torch_optimizers(self.optimizer):
            for group in opt.param_groups:
                for p in group["params"]:
                    if not opt.state[p]:
                        opt.state[p]["exp_avg"] = torch.zeros_like(p.data)
                        opt.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)
                        opt.state[p]["step"] = torch.tensor(0.0)

    def load(self, path: str | Path, with_optimizer: bool | None = None) -> dict[str, Any]:
        """Load a checkpoint, resharding the model to this run's TP/PP. The optimizer state is loaded
        when the layout matches (DP-reshardable only), else the optimizer starts fresh."""
        from megatron.core import dist_checkpointing

        path = Path(path)
        meta = json.loads((path / "agent_r1_state.json").read_text())
        same_layout = meta["tp"] == self.bridge.tp and meta["pp"] == self.bridge.pp
        want_opt = (
            meta["with_optimizer"]
            and self.optimizer is not None
            and (same_layout if with_optimizer is None else with_optimizer)
        )
        model_sd = self.module.sharded_state_dict()
        state = {"model": model_sd}
        if want_opt:
            self._init_optimizer_state()
            state["optimizer"] = self.optimizer.sharded_state_dict(
                model_sd, is_loading=True, metadata={"distrib_optim_sharding_type": "dp_reshardable"}
            )
        loaded = dist_checkpointing.load(state, str(path))
        self.module.load_state_dict(loaded["model"])
        if want_opt:
            with torch.no_grad():  # fp32: main params are views of the model params
                self.optimizer.load_state_dict(loaded["optimizer"])
            # torch Adam's per-parameter step is not in the DP-reshardable format: restore it from
            # our own count (every parameter is stepped each update; skipped updates raise)
            for opt in _torch_optimizers(self.optimizer):
                for st in opt.state.values():
                    if "step" in st:
                        st["step"] = torch.tensor(float(meta["steps"]))
        self.steps = meta["steps"]
        if self.scheduler is not None and meta["scheduler"] is not None:
            self.scheduler.load_state_dict(meta["scheduler"])
        return meta["trainer"]


def _torch_optimizers(opt: Any) -> list[Any]:
    chained = getattr(opt, "chained_optimizers", [opt])
    return [c.optimizer for c in chained if getattr(c, "optimizer", None) is not None]


def _step_offsets(trajectories: list[list[dict]]) -> list[int]:
    out, n = [], 0
    for t in trajectories:
        out.append(n)
        n += len(t)
    return out


def _global_rows(members: list[int], trajectories: list[list[dict]], starts: list[int]) -> torch.Tensor:
    """Micro-batch step index -> global step row (steps of the member trajectories, in order)."""
    return torch.tensor(
        [starts[i] + k for i in members for k in range(len(trajectories[i]))], dtype=torch.int64
    )


def _split_by_step(values: torch.Tensor, mb: Packed, rows: torch.Tensor) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for local, v in zip(mb.label_step.tolist(), values.tolist(), strict=True):
        out.setdefault(int(rows[local]), []).append(v)
    for local in range(mb.num_steps):  # steps without action tokens
        out.setdefault(int(rows[local]), [])
    return out
