"""The Qwen2-VL family's geometry shared by the rollout engine and the learner.

- ``mrope_positions``: the three rotary position rows (time, height, width) of a prompt with
  images, as transformers' ``Qwen2VLModel.get_rope_index`` lays them out: text tokens count up on
  all three rows; an image's merged patches take (start, start + row, start + column); the text
  after it resumes at start + max(rows, columns). Tokens after the prompt continue at
  ``position + delta``, all three rows equal.
- ``hf_module_name``: the checkpoint (HF hub) names of a Qwen2-VL model -> the names of its
  modules in transformers >= 5 (``model.layers.*`` -> ``model.language_model.layers.*``,
  ``visual.*`` -> ``model.visual.*``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from agent_r1.vision.images import Image, VisionSpec

VISION_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")  # the Qwen2-VL family (same layout of images)


def is_vision_config(cfg: Any) -> bool:
    return getattr(cfg, "model_type", None) in VISION_MODEL_TYPES


def mrope_positions(
    ids: list[int] | np.ndarray,
    image_token_id: int,
    grids: list[tuple[int, int, int]],
    merge: int,
    is_pad: np.ndarray | None = None,
) -> tuple[np.ndarray, int]:
    """(3, len(ids)) int64 rotary positions and the delta for the tokens after them. ``is_pad``:
    which tokens are image pads (default: every ``image_token_id``; a learner passes the
    observation's, since a sampled pad token in an action is text)."""
    ids = np.asarray(ids)
    n = len(ids)
    out = np.empty((3, n), dtype=np.int64)
    is_pad = ids == image_token_id if is_pad is None else np.asarray(is_pad, dtype=bool)
    i, pos, g = 0, 0, 0
    while i < n:
        if not is_pad[i]:
            j = i
            while j < n and not is_pad[j]:
                j += 1
            out[:, i:j] = np.arange(pos, pos + j - i)
            pos += j - i
            i = j
            continue
        if g >= len(grids):
            raise ValueError(f"more <|image_pad|> runs than the {len(grids)} image grid(s) given")
        t, h, w = grids[g]
        lh, lw = h // merge, w // merge
        size = t * lh * lw
        if not is_pad[i : i + size].all() or (i + size < n and is_pad[i + size]):
            raise ValueError(f"image {g}: its pad run at {i} is not {size} tokens long")
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(lh), np.arange(lw), indexing="ij")
        out[0, i : i + size] = tt.reshape(-1) + pos
        out[1, i : i + size] = hh.reshape(-1) + pos
        out[2, i : i + size] = ww.reshape(-1) + pos
        pos += max(h, w) // merge
        i += size
        g += 1
    if g != len(grids):
        raise ValueError(f"{len(grids)} image grid(s) but {g} <|image_pad|> run(s)")
    return out, int(out.max() + 1 - n) if n else 0


@dataclass(frozen=True)
class Geometry:
    """How a model lays out prompts with images: its image geometry and pad token."""

    spec: VisionSpec
    image_token_id: int

    @classmethod
    def of(cls, model_dir: str | Path) -> Geometry | None:
        """The geometry of an HF folder's model; None for a text-only model."""
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        if cfg.get("model_type") not in VISION_MODEL_TYPES:
            return None
        spec = VisionSpec.from_folder(model_dir)
        if spec is None:
            raise ValueError(f"{model_dir}: a vision model without preprocessor_config.json")
        return cls(spec, int(cfg["image_token_id"]))

    def positions(
        self, ids: list[int] | np.ndarray, images: list[Image], is_pad: np.ndarray | None = None
    ) -> tuple[np.ndarray, int]:
        return mrope_positions(
            ids, self.image_token_id, [self.spec.grid(im) for im in images], self.spec.merge_size, is_pad
        )


def mrope_sections(cfg: Any, head_dim: int) -> torch.Tensor:
    """For each rotary dimension (head_dim), which position row (0 t, 1 h, 2 w) drives it."""
    text = getattr(cfg, "text_config", cfg)
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    sec = rope.get("mrope_section")
    if not sec or 2 * sum(sec) != head_dim:
        raise ValueError(f"mrope_section {sec} does not cover head_dim {head_dim} (sum must be head_dim / 2)")
    half = torch.cat([torch.full((s,), i % 3, dtype=torch.long) for i, s in enumerate(sec)])
    return torch.cat([half, half])


def image_processor(model_dir: str) -> Any:
    """transformers' Qwen2-VL image processor of a model folder (its PIL backend: no torchvision)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil.from_pretrained(model_dir)


def pixel_values(processor: Any, images: list[Image]) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel_values, image_grid_thw) of the images, as the HF processor makes them."""
    out = processor(images=[im.to_pil() for im in images], return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def hf_module_name(name: str) -> str:
    """A Qwen2-VL checkpoint name as the transformers >= 5 module names it (others unchanged)."""
    if name.startswith("visual."):
        return "model." + name
    if name.startswith("model.") and not name.startswith(("model.language_model.", "model.visual.")):
        return "model.language_model." + name[len("model.") :]
    return name


def checkpoint_name(name: str) -> str:
    """The inverse of ``hf_module_name``: a transformers >= 5 module name as the checkpoint names it."""
    if name.startswith("model.visual."):
        return name[len("model.") :]
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model.") :]
    return name
