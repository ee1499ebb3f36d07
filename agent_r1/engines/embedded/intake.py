"""A ``/generate``'s fields as the embedded engine's ``Request`` objects (a mixin of ``Engine``):
sampling parameters checked (a bad one names the field), token ids checked against the vocabulary,
images loaded and their pads matched, ``n`` samples per prompt."""

from __future__ import annotations

import logging
import uuid
from typing import Any

import torch

from agent_r1.engines.embedded.requests import Request
from agent_r1.engines.embedded.sampling import Sampling, is_token_id
from agent_r1.http_service import BadRequest, TooLarge
from agent_r1.vision.images import Image, ImageError, load_image, pad_runs
from agent_r1.vision.qwen2_vl import mrope_positions

log = logging.getLogger("agent_r1.engine")


class Intake:
    """``Engine``'s request building (its tokenizer, vocabulary, limits and vision tower)."""

    def make_requests(
        self,
        input_ids: list[int],
        sampling: dict[str, Any] | None,
        rid: str | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        image_data: Any = None,
    ) -> list[Request]:
        """Validate one prompt and expand ``n``; raises BadRequest naming the field."""
        if not isinstance(input_ids, list) or not input_ids:
            raise BadRequest("input_ids: must be a non-empty list of token ids")
        bad = [t for t in input_ids if not is_token_id(t, self.vocab_size)]
        if bad:
            raise BadRequest(f"input_ids: token id {bad[0]!r} outside the vocabulary [0, {self.vocab_size})")
        if len(input_ids) >= self.max_len:
            raise BadRequest(
                f"input_ids: prompt of {len(input_ids)} tokens does not fit the context length {self.max_len}"
            )
        if self.max_prompt_tokens and len(input_ids) > self.max_prompt_tokens:
            raise TooLarge(
                f"input_ids: prompt of {len(input_ids)} tokens; this server takes at most "
                f"{self.max_prompt_tokens} (--max-prompt-tokens)"
            )
        s = Sampling.from_dict(sampling, self.vocab_size)
        if not isinstance(top_logprobs_num, int) or top_logprobs_num < 0:
            raise BadRequest(f"top_logprobs_num: must be an integer >= 0, got {top_logprobs_num!r}")
        if not isinstance(logprob_start_len, int) or logprob_start_len < -1:
            raise BadRequest(f"logprob_start_len: must be an integer >= -1, got {logprob_start_len!r}")
        if rid is not None and not isinstance(rid, str):
            raise BadRequest(f"rid: must be a string, got {type(rid).__name__}")
        rid = rid or uuid.uuid4().hex
        images, rope, delta = self._images(input_ids, image_data)
        out = []
        for i in range(s.n):
            gen = torch.Generator().manual_seed(s.sampling_seed + i) if s.sampling_seed is not None else None
            out.append(
                Request(
                    rid if s.n == 1 else f"{rid}-{i}",
                    list(input_ids),
                    s,
                    return_logprob,
                    top_logprobs_num,
                    logprob_start_len,
                    index=i,
                    gen=gen,
                    stops=frozenset(s.stop_token_ids)
                    | (frozenset() if s.ignore_eos else frozenset(self.eos_ids)),
                    images=images,
                    image_pad=self.image_pad_id if images else -1,
                    rope=rope,
                    rope_delta=delta,
                )
            )
        return out

    @property
    def image_pad_id(self) -> int:
        return int(self.model.config.image_token_id)

    def _images(self, input_ids: list[int], image_data: Any) -> tuple[list[Image], torch.Tensor | None, int]:
        """The prompt's images (SGLang's ``image_data``: base64 strings or data URLs), checked
        against its pad runs, and its multimodal rotary positions."""
        if image_data is None or image_data == []:
            if self.vision is not None and self.image_pad_id in input_ids:
                raise BadRequest("image_data: input_ids hold <|image_pad|> tokens but no image was sent")
            return [], None, 0
        if self.vision is None:
            raise BadRequest(f"image_data: {self.model_dir} is a text-only model; it takes no images")
        items = image_data if isinstance(image_data, list) else [image_data]
        spec = self.vision_spec
        if len(items) > spec.max_images:
            raise BadRequest(
                f"image_data: {len(items)} images, more than the model's {spec.max_images} per prompt"
            )
        try:
            images = [load_image(x, f"image_data[{i}]") for i, x in enumerate(items)]
            grids = [spec.grid(im) for im in images]
        except (ImageError, OSError, ValueError) as e:  # whatever the data was, the request's fault
            raise BadRequest(
                str(e) if isinstance(e, ImageError) else f"image_data: {type(e).__name__}: {e}"
            ) from None
        runs = [b - a for a, b in pad_runs(input_ids, self.image_pad_id)]
        want = [spec.num_tokens(im) for im in images]
        if runs != want:
            raise BadRequest(
                f"image_data: input_ids' <|image_pad|> runs {runs} do not match the {len(images)} "
                f"image(s), which take {want} tokens"
            )
        pos, delta = mrope_positions(input_ids, self.image_pad_id, grids, spec.merge_size)
        return images, torch.from_numpy(pos), delta
