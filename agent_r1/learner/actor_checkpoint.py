"""The policy's weights and state out and in (a mixin of ``Actor``): HF-named tensors for the weight
push and HF checkpoints, and Megatron ``dist_checkpointing`` saves and loads (checksummed, resharded
on load, a full disk a clear error)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from agent_r1.learner.checkpoint_files import (
    CheckpointError,
    first_nonfinite,
    no_space,
    no_space_error,
    verify_checksums,
    write_checksums,
)
from agent_r1.learner.optim import torch_optimizers


class ActorCheckpoint:
    """``Actor``'s export, save and load."""

    def export_hf(self):
        """HF-named full tensors of this rank's stage (for weight sync / HF checkpoints); a
        trained vision tower's too (a frozen one never changes: the servers keep theirs)."""
        from megatron_bridge import export_hf_weights

        for module in self.modules:
            yield from export_hf_weights(module, self.hf_config)
            vision = getattr(module, "vision_encoder", None)
            if vision is not None and vision.trainable:
                yield from vision.export_hf()

    # ---- checkpoints --------------------------------------------------------------------------------------
    def save(
        self, path: str | Path, trainer_state: dict[str, Any] | None = None, with_optimizer: bool = True
    ) -> None:
        """dist_checkpointing (torch_dist) of the model (+ optimizer, DP-reshardable), trainer state
        beside it, a checksum per file; written to ``path.tmp`` and renamed, so a crash never leaves
        a half checkpoint. A full disk is reported as such (and the partial write removed)."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        try:
            self._save(path, tmp, trainer_state, with_optimizer)
        except Exception as e:
            if not no_space(e, tmp):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            raise no_space_error(tmp, e) from e

    def _save(
        self, path: Path, tmp: Path, trainer_state: dict[str, Any] | None, with_optimizer: bool
    ) -> None:
        import torch.distributed as dist
        from megatron.core import dist_checkpointing

        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        model_sd = self._sharded_state_dict()
        state = {"model": model_sd}
        # an optimizer that never stepped (a critic after the warm start) has no state to save
        with_optimizer = with_optimizer and self.optimizer is not None and self.steps > 0
        if with_optimizer:
            state["optimizer"] = self.optimizer.sharded_state_dict(
                model_sd, metadata={"distrib_optim_sharding_type": "dp_reshardable"}
            )
            zero_padding(state["optimizer"])
        dist_checkpointing.save(state, str(tmp))
        dist.barrier()
        if dist.get_rank() == 0:
            meta = {
                "steps": self.steps,
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                "with_optimizer": with_optimizer,
                "tp": self.bridge.tp,
                "pp": self.bridge.pp,
                "ep": self.bridge.ep,
                "vpp": self.bridge.vpp,
                "cp": self.bridge.cp,
                "trainer": trainer_state or {},
            }
            (tmp / "agent_r1_state.json").write_text(json.dumps(meta, indent=1))
            write_checksums(tmp)
            if path.exists():
                shutil.rmtree(path)
            os.replace(tmp, path)
        dist.barrier()

    def _sharded_state_dict(self) -> dict[str, Any]:
        """The model's dist_checkpointing state dict: one chunk's, or with virtual pipeline stages
        ``chunkN`` per stage (the tensors' checkpoint keys hold global layer numbers, so a
        checkpoint reshards across pipeline and virtual-stage layouts alike)."""
        sds = [module.sharded_state_dict() for module in self.modules]
        return sds[0] if len(sds) == 1 else {f"chunk{i}": sd for i, sd in enumerate(sds)}

    def _load_state_dict(self, loaded: dict[str, Any]) -> None:
        modules = self.modules
        if len(modules) == 1:
            modules[0].load_state_dict(loaded)
            return
        for i, module in enumerate(modules):
            module.load_state_dict(loaded[f"chunk{i}"])

    def _init_optimizer_state(self) -> None:
        """A never-stepped torch Adam has no state; the checkpoint format expects moments and a
        step per parameter, so create empty ones before loading into them."""
        for opt in torch_optimizers(self.optimizer):
            for group in opt.param_groups:
                for p in group["params"]:
                    if not opt.state[p]:
                        opt.state[p]["exp_avg"] = torch.zeros_like(p.data)
                        opt.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)
                        opt.state[p]["step"] = torch.tensor(0.0)

    def load(self, path: str | Path, with_optimizer: bool | None = None) -> dict[str, Any]:
        """Load a checkpoint, resharding the model to this run's TP/PP/EP. The optimizer state is
        loaded when the layout matches (DP-reshardable only), else the optimizer starts fresh."""
        import torch.distributed as dist
        from megatron.core import dist_checkpointing

        path = Path(path)
        box = [None]
        if dist.get_rank() == 0:  # one rank reads every byte; the verdict goes to all
            try:
                verify_checksums(path)
            except CheckpointError as e:
                box[0] = str(e)
        dist.broadcast_object_list(box, src=0)
        if box[0]:
            raise CheckpointError(box[0])
        meta = json.loads((path / "agent_r1_state.json").read_text())
        layout = tuple(meta.get(k, 1) for k in ("tp", "pp", "ep", "vpp", "cp"))
        b = self.bridge
        same_layout = layout == (b.tp, b.pp, b.ep, b.vpp, b.cp)
        want_opt = (
            meta["with_optimizer"]
            and self.optimizer is not None
            and (same_layout if with_optimizer is None else with_optimizer)
        )
        model_sd = self._sharded_state_dict()
        state = {"model": model_sd}
        if want_opt:
            self._init_optimizer_state()
            state["optimizer"] = self.optimizer.sharded_state_dict(
                model_sd, is_loading=True, metadata={"distrib_optim_sharding_type": "dp_reshardable"}
            )
        loaded = dist_checkpointing.load(state, str(path))
        self._load_state_dict(loaded["model"])
        bad = [None] * dist.get_world_size()
        params = (p for module in self.modules for p in module.named_parameters())
        dist.all_gather_object(bad, first_nonfinite(params))
        if any(bad):
            rank = next(r for r, b in enumerate(bad) if b)
            raise CheckpointError(
                f"checkpoint {path}: parameter {bad[rank]} (learner rank {rank}) is not finite after loading"
            )
        if want_opt:
            with torch.no_grad():  # fp32: main params are views of the model params
                self.optimizer.load_state_dict(loaded["optimizer"])
            # torch Adam's per-parameter step is not in the DP-reshardable format: restore it from
            # our own count (every parameter is stepped each update; skipped updates raise)
            for opt in torch_optimizers(self.optimizer):
                for st in opt.state.values():
                    if "step" in st:
                        st["step"] = torch.tensor(float(meta["steps"]))
        self.steps = meta["steps"]
        if self.logprob_values is not None:
            self.logprob_values.version = None  # new weights at a step count it may have seen
        if self.scheduler is not None and meta["scheduler"] is not None:
            self.scheduler.load_state_dict(meta["scheduler"])
        return meta["trainer"]


def zero_padding(sd: Any) -> None:
    """Zero the gaps between parameters that the distributed optimizer's bucket-space state dict
    fills with ``torch.empty`` (entries marked ``padding``): a checkpoint holds no uninitialised
    memory, and the same run saves the same bytes."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor

    if isinstance(sd, dict):
        pad = sd.get("padding")
        if isinstance(pad, LocalNonpersistentObject) and pad.obj is True:
            for v in sd.values():
                if isinstance(v, ShardedTensor):
                    v.data.zero_()
        for v in sd.values():
            zero_padding(v)
    elif isinstance(sd, list | tuple):
        for v in sd:
            zero_padding(v)
