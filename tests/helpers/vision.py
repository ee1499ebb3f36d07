"""Images and the HF processor for the vision tests.

``hf_processor`` is transformers' own ``Qwen2VLProcessor`` over the folder's image processor and
tokenizer; it is built without the video processor, which needs torchvision (not installable
beside the CPU torch here) and which image prompts never use.
"""

from __future__ import annotations

import io
import random
from pathlib import Path
from typing import Any


def image_bytes(width: int, height: int, seed: int = 0, fmt: str = "PNG") -> bytes:
    """A seeded image of random colour blocks, encoded."""
    from PIL import Image

    rng = random.Random(seed)
    im = Image.new("RGB", (width, height))
    px = im.load()
    for y in range(height):
        for x in range(width):
            b = (x // 7 + y // 5 + seed) % 5
            px[x, y] = (50 * b, rng.randrange(256), 255 - 40 * b)
    buf = io.BytesIO()
    im.save(buf, format=fmt)
    return buf.getvalue()


def hf_processor(model_dir: str | Path) -> Any:
    from transformers import AutoTokenizer, Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    class ImageOnlyProcessor(Qwen2VLProcessor):
        def check_argument_for_proper_class(self, name: str, arg: Any) -> Any:
            if name == "video_processor" and arg is None:
                return None
            return super().check_argument_for_proper_class(name, arg)

    tok = AutoTokenizer.from_pretrained(model_dir)
    ip = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    return ImageOnlyProcessor(
        image_processor=ip, tokenizer=tok, video_processor=None, chat_template=tok.chat_template
    )
