"""The policy learner: a Megatron-Core GPTModel stage (built by megatron_bridge), wrapped in
Megatron DDP with the distributed optimizer, trained through Megatron's pipeline schedules on
prefix-merged packed micro-batches with the losses of ``agent_r1.algos.losses``.

Every rank of the model-parallel group calls the same methods with the same trajectories; data
parallel ranks call them with their own trajectories (gradients are averaged by DDP).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from agent_r1.cpus import ThreadGovernor
from agent_r1.learner.actor_checkpoint import ActorCheckpoint
from agent_r1.learner.actor_steps import ActorSteps
from agent_r1.learner.backend import Backend, main_grad
from agent_r1.learner.optim import OptimConfig, use_fused_adam
from agent_r1.vision.qwen2_vl import is_vision_config, mrope_sections


def read_hf_state(hf_dir: Path, hf_config: Any, backend: Backend) -> dict[str, torch.Tensor]:
    """The HF folder's weights; in a plan, tensors of their names and shapes on the planned device
    (the HF model built there from its config: no file read, no memory)."""
    from safetensors.torch import load_file

    if backend.plan is not None:
        from agent_r1.learner.backend.dry_run import hf_state

        return hf_state(hf_config)
    state = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


class Actor(ActorSteps, ActorCheckpoint):
    """The policy (and, through ``Critic``, the value model): this rank's Megatron stage, its
    optimizer and scheduler, on ``self.device`` (this rank's GPU, else the CPU)."""

    def __init__(
        self,
        hf_dir: str | Path,
        bridge: Any,
        optim: OptimConfig,
        seed: int = 0,
        trainable: bool = True,
        train_vision: bool = False,
        temperature: float = 1.0,
        backend: Backend | None = None,
        adapt_threads: bool = True,
        logprob_values: Any = None,
    ):
        """``backend``: what this rank runs on (``Backend.here()``: its GPU, else the CPU; a plan's
        from ``agent-r1 plan``). ``adapt_threads``: on a CPU the thread count of each step is chosen
        from measured step times; False keeps it fixed (``trainer.deterministic``: sums such as the
        loss's and the gradient norm's split by thread count, so their bits would follow the load).
        ``logprob_values``: where the policy's logprobs take their values from (their gradients
        stay this model's): an object with ``version``, ``load(hf_tensors, version)`` and
        ``logprobs(tokens, bounds, labels)`` (the embedded engine's ``Scorer``:
        ``trainer.deterministic``'s true on-policy, every logprob the engine's bits)."""
        from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from transformers import AutoConfig

        from megatron_bridge import build_gpt_chunks, language_config, load_hf_weights

        self.hf_dir, self.bridge, self.optim_cfg = Path(hf_dir), bridge, optim
        # the T of the rollout's logprobs (rollout.protocol.logprob_temperature; packed_logprobs
        # checks it): SGLang and the embedded engine return them under softmax(logits / T)
        self.temperature = temperature
        self.backend = backend or Backend.here()
        self.device = self.backend.device
        bridge = self.bridge = dataclasses.replace(bridge, for_gpu=self.backend.builds_for_gpu)
        threads = torch.get_num_threads()
        adapt = adapt_threads and self.device.type == "cpu" and threads > 1
        self.governor = ThreadGovernor(threads) if adapt else None
        self.hf_config = AutoConfig.from_pretrained(self.hf_dir)
        self.logprob_values = logprob_values
        self.train_vision = bool(train_vision and trainable)
        model_parallel_cuda_manual_seed(seed)
        state = read_hf_state(self.hf_dir, self.hf_config, self.backend)
        self._adapt_hf(state)
        # this rank's pipeline stage: one model chunk, or with virtual pipeline stages one per
        # stage (sharing one TransformerConfig, which the schedule reads from the first)
        modules = build_gpt_chunks(self.hf_config, bridge)
        for module in modules:
            load_hf_weights(module, state, self.hf_config)
            self._adapt_model(module)
        self.lm_config = language_config(self.hf_config)
        if is_vision_config(self.hf_config):
            self._attach_vision(modules, state)
        for module in modules:
            module.to(self.device)
        cfg = modules[0].config
        self.trainable = trainable
        self.router_stats = None
        if cfg.num_moe_experts and trainable:
            from agent_r1.learner.moe_stats import RouterStats

            self.router_stats = RouterStats(modules, self.backend)
        if not trainable:  # a frozen reference policy: no DDP, no optimizer
            for module in modules:
                module.requires_grad_(False)
            self.chunks, self.optimizer, self.scheduler, self.steps = modules, None, None, 0
            return
        ddp = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=optim.distributed_optimizer
        )
        ddp_class = main_grad.ddp_class()  # upstream's DDP; bf16 gradients added natively on a CPU
        self.chunks = [ddp_class(cfg, ddp, module) for module in modules]
        for chunk in self.chunks:
            _skip_single_rank_sync(chunk)
        cfg.finalize_model_grads_func = finalize_model_grads
        one = len(self.chunks) == 1  # the interleaved schedule takes one function per chunk
        cfg.no_sync_func = self.chunks[0].no_sync if one else [c.no_sync for c in self.chunks]
        cfg.grad_sync_func = (
            self.chunks[0].start_grad_sync if one else [c.start_grad_sync for c in self.chunks]
        )
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
            self.chunks,
        )
        use_fused_adam(self.optimizer)
        self.scheduler = self.make_scheduler(optim)
        self.steps = 0

    def _attach_vision(self, modules: list[Any], state: dict[str, torch.Tensor]) -> None:
        """A vision-language model: multimodal rotary positions on every stage, and on the first
        stage the vision tower as the submodule ``vision_encoder`` (so DDP, the optimizer when it
        trains, and checkpoints see it; frozen by default)."""
        from agent_r1.learner.forward import install_packed_rotary
        from agent_r1.learner.vision import VisionEncoder

        lm = self.lm_config
        head_dim = getattr(lm, "head_dim", None) or lm.hidden_size // lm.num_attention_heads
        for module in modules:
            install_packed_rotary(module, mrope_sections(self.hf_config, head_dim)[: head_dim // 2])
            if module.pre_process:
                module.vision_encoder = VisionEncoder(
                    self.hf_config, str(self.hf_dir), state, self.train_vision
                )

    def _adapt_hf(self, state: dict[str, torch.Tensor]) -> None:
        """Hook before the model is built (the critic unties the output layer)."""

    def _adapt_model(self, module: Any) -> None:
        """Hook after the HF weights are loaded (the critic swaps in its value head)."""

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
    def modules(self) -> list[Any]:
        """This rank's GPTModel chunks, unwrapped: its pipeline stage, or its virtual stages."""
        return [c.module for c in self.chunks] if self.trainable else list(self.chunks)

    @property
    def module(self) -> Any:
        """This rank's GPTModel stage (one chunk; with virtual pipeline stages use ``modules``)."""
        (module,) = self.modules
        return module

    def _each(self, method: str) -> None:
        for chunk in self.chunks:
            getattr(chunk, method)()


def _skip_single_rank_sync(model: Any) -> None:
    """With one data-parallel rank there is nothing to reduce or gather, but Megatron's buckets
    would still send every gradient (reduce-scatter / all-reduce) and every parameter
    (all-gather) through a one-rank collective, a full copy of the model each way per step.
    Dense and expert parameters count apart: experts (expert TP 1) are data-parallel over the
    TP ranks too (each routes its own tokens under sequence parallelism), so at TP 2 and DP 1
    their gradients still sum over two ranks."""
    from megatron.core import parallel_state as ps

    if ps.get_data_parallel_world_size(with_context_parallel=True) != 1:
        return  # (expert gradients are scaled by 1 / dp in their sync even where their group is one rank)
    single = list(model.bucket_groups)
    if ps.get_expert_data_parallel_world_size() == 1:
        single += model.expert_parallel_bucket_groups
    for group in single:
        assert all(b.gradient_scaling_factor == 1.0 for b in group.buckets)  # 1 / dp: nothing to scale
        group.start_grad_sync = _noop
        group.start_param_sync = _noop


def _noop(*args: Any, **kwargs: Any) -> None:
    return None
