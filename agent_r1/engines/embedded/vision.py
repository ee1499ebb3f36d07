"""The engine's vision tower (Qwen2-VL family): image -> the embeddings that replace its
``<|image_pad|>`` tokens, through the HF model's own vision module and image processor, cached by
the image's hash (an image seen again -- the next step of a trajectory, another sample of its
group -- is never run through the tower twice)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from agent_r1.vision.images import Image
from agent_r1.vision.qwen2_vl import image_processor, pixel_values


class VisionTower:
    """Image embeddings of an HF Qwen2-VL model (its ``model.visual``), cached by image hash."""

    def __init__(self, model: Any, model_dir: str, max_images: int = 256):
        self.model = model
        self.processor = image_processor(model_dir)
        self.merge = int(model.config.vision_config.spatial_merge_size)
        self.cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.max_images = max_images
        self.computed = 0  # images run through the tower (cache misses)

    def pixels(self, images: list[Image]) -> tuple[torch.Tensor, torch.Tensor]:
        return pixel_values(self.processor, images)

    @torch.inference_mode()
    def embeddings(self, images: list[Image]) -> list[torch.Tensor]:
        """One (tokens, hidden) tensor per image; the tower runs once over the images not cached."""
        have = {im.hash: self.cache[im.hash] for im in images if im.hash in self.cache}
        todo = list({im.hash: im for im in images if im.hash not in have}.values())
        if todo:
            pv, grid = self.pixels(todo)
            dev = next(self.model.parameters()).device
            feats = self.model.model.get_image_features(pv.to(dev), grid.to(dev)).pooler_output
            have.update({im.hash: f for im, f in zip(todo, feats, strict=True)})
            self.computed += len(todo)
        for h, f in have.items():  # most recently used last
            self.cache[h] = f
            self.cache.move_to_end(h)
        while len(self.cache) > self.max_images:
            self.cache.popitem(last=False)
        return [have[im.hash] for im in images]

    def clear(self) -> None:
        self.cache.clear()
