"""The learner's vision tower (Qwen2-VL family): images -> the embeddings of their pad tokens.

The tower is transformers' own vision module of the model (``Qwen2VisionTransformerPretrainedModel``,
Qwen2.5-VL's ``Qwen2_5_VisionTransformerPretrainedModel``; built from the HF config's ``vision_config`` and the checkpoint's ``visual.*`` tensors), replicated
on every rank of the first pipeline stage; its output replaces the ``<|image_pad|>`` rows of the
language model's input embeddings (Megatron's ``decoder_input``). Frozen by default (computed
without a graph, cached by image hash within an iteration); ``trainable=True`` trains it with the
policy, its gradients all-reduced over the data- and tensor-parallel ranks that computed the same
images. Its tensors keep their checkpoint names in checkpoints and weight sync.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from agent_r1.vision.images import Image
from agent_r1.vision.qwen2_vl import image_processor, pixel_values

PREFIX = "visual."  # the tower's tensors in a Qwen2-VL checkpoint


def _tower_class(model_type: str) -> Any:
    if model_type == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel,
        )

        return Qwen2_5_VisionTransformerPretrainedModel
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    return Qwen2VisionTransformerPretrainedModel


class VisionEncoder(torch.nn.Module):
    def __init__(
        self, hf_config: Any, model_dir: str, state: dict[str, torch.Tensor], trainable: bool = False
    ):
        super().__init__()
        self.tower = _tower_class(hf_config.model_type)._from_config(hf_config.vision_config)
        own = {PREFIX + k for k in self.tower.state_dict()}
        given = {k for k in state if k.startswith(PREFIX)}
        if own != given:
            raise KeyError(
                f"vision tower weights: missing {sorted(own - given)[:3]}, unexpected {sorted(given - own)[:3]}"
            )
        tower = {k[len(PREFIX) :]: v for k, v in state.items() if k.startswith(PREFIX)}
        if not any(t.device.type == "meta" for t in tower.values()):  # planned weights: no values
            self.tower.load_state_dict(tower)
        self.processor = image_processor(model_dir)
        self.trainable = trainable
        self.tower.requires_grad_(trainable)
        self.tower.train(False)
        self._frozen: dict[str, torch.Tensor] = {}  # frozen: features by image hash

    def pixels(self, images: list[Image]) -> tuple[torch.Tensor, torch.Tensor]:
        return pixel_values(self.processor, images)

    def forward(self, images: list[Image]) -> torch.Tensor:
        """(pads of all images, hidden): the images' embeddings in order, one row per pad."""
        if not images:
            raise ValueError("no images")
        dev = next(self.tower.parameters()).device
        dtype = next(self.tower.parameters()).dtype
        if self.trainable:
            pv, grid = self.pixels(images)
            return self.tower(pv.to(dev, dtype), grid_thw=grid.to(dev)).pooler_output
        todo = list({im.hash: im for im in images if im.hash not in self._frozen}.values())
        if todo:
            pv, grid = self.pixels(todo)
            with torch.no_grad():
                feats = self.tower(pv.to(dev, dtype), grid_thw=grid.to(dev)).pooler_output
            sizes = (grid.prod(-1) // self.tower.spatial_merge_size**2).tolist()
            self._frozen.update({im.hash: f for im, f in zip(todo, feats.split(sizes), strict=True)})
        return torch.cat([self._frozen[im.hash] for im in images])

    def clear(self) -> None:
        """Forget cached features (after an optimizer step of a trainable tower; per iteration)."""
        self._frozen.clear()

    def export_hf(self) -> Iterator[tuple[str, torch.Tensor]]:
        for k, v in self.tower.state_dict().items():
            yield PREFIX + k, v.detach().clone()
