"""Images in observations: loading and checking them, their content hash, and how many vision
tokens one becomes in the Qwen2-VL family.

An ``Image`` is the encoded file as given (PNG, JPEG or WebP bytes), checked once by decoding it,
and named by the SHA-256 of those bytes: records store it once per trajectory under that hash,
engines cache its vision features under it. A chat message carries images as content parts in the
OpenAI / Qwen-VL list form::

    {"role": "user", "content": [{"type": "image", "image": <bytes | PIL image | path | data URL>},
                                 {"type": "text", "text": "How many bars?"}]}

(``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`` is read too). The
chat codec of a vision model renders each image as ``<|vision_start|>`` + N x ``<|image_pad|>``
+ ``<|vision_end|>``, N from ``VisionSpec.num_tokens`` — exactly as the HF processor expands it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent_r1.errors import AgentR1Error

FORMATS = ("PNG", "JPEG", "WEBP")  # what an image may be encoded as
MAX_BYTES = 16 << 20  # an encoded image larger than this is refused before decoding
MAX_DECODED_PIXELS = 64 << 20  # decompression-bomb guard (a tiny PNG that decodes huge)


class ImageError(AgentR1Error, ValueError):
    """An image is corrupt, too large, of an unsupported format, or sent where none can go."""


@dataclass(frozen=True)
class Image:
    """One encoded image as given, checked; ``hash`` = SHA-256 hex of ``data``."""

    data: bytes = field(repr=False)
    hash: str
    format: str
    width: int
    height: int

    @classmethod
    def from_bytes(cls, data: bytes, where: str = "image") -> Image:
        if not isinstance(data, bytes | bytearray | memoryview):
            raise ImageError(f"{where}: expected encoded image bytes, got {type(data).__name__}")
        data = bytes(data)
        if not data:
            raise ImageError(f"{where}: empty image")
        if len(data) > MAX_BYTES:
            raise ImageError(f"{where}: {len(data)} bytes, more than the {MAX_BYTES}-byte limit")
        from PIL import Image as PILImage

        try:
            with PILImage.open(io.BytesIO(data)) as im:
                fmt = im.format
                if fmt not in FORMATS:
                    raise ImageError(
                        f"{where}: format {fmt} is not supported (use one of {', '.join(FORMATS)})"
                    )
                w, h = im.size
                if w * h > MAX_DECODED_PIXELS:
                    raise ImageError(f"{where}: {w}x{h} pixels, more than the {MAX_DECODED_PIXELS} limit")
                im.load()  # decodes every pixel: a truncated or corrupt file fails here
        except ImageError:
            raise
        except (OSError, ValueError, SyntaxError, PILImage.DecompressionBombError) as e:
            raise ImageError(f"{where}: not a readable image ({type(e).__name__}: {e})") from None
        return cls(data, hashlib.sha256(data).hexdigest(), fmt, w, h)

    @classmethod
    def from_pil(cls, im: Any, where: str = "image") -> Image:
        buf = io.BytesIO()
        im.save(buf, format="PNG")
        return cls.from_bytes(buf.getvalue(), where)

    def to_pil(self) -> Any:
        """The decoded image in RGB (what the vision tower sees)."""
        from PIL import Image as PILImage

        return PILImage.open(io.BytesIO(self.data)).convert("RGB")

    def data_url(self) -> str:
        return f"data:image/{self.format.lower()};base64," + base64.b64encode(self.data).decode()

    def base64(self) -> str:
        return base64.b64encode(self.data).decode()


def load_image(src: Any, where: str = "image") -> Image:
    """An ``Image`` from bytes, a PIL image, a file path, a ``data:`` URL or a bare base64 string."""
    if isinstance(src, Image):
        return src
    if isinstance(src, bytes | bytearray | memoryview):
        return Image.from_bytes(bytes(src), where)
    if hasattr(src, "save") and hasattr(src, "size"):  # a PIL image
        return Image.from_pil(src, where)
    if isinstance(src, Path):
        src = str(src)
    if isinstance(src, str):
        if src.startswith("data:"):
            head, _, payload = src.partition(",")
            if ";base64" not in head:
                raise ImageError(f"{where}: a data URL must be base64-encoded")
            return Image.from_bytes(_b64(payload, where), where)
        if src.startswith(("http://", "https://")):
            raise ImageError(f"{where}: image URLs are not fetched; send the bytes (data URL or base64)")
        p = _file(src)
        if p is not None:
            if p.stat().st_size > MAX_BYTES:
                raise ImageError(
                    f"{where}: {p} is {p.stat().st_size} bytes, more than the {MAX_BYTES}-byte limit"
                )
            return Image.from_bytes(p.read_bytes(), f"{where} ({p})")
        return Image.from_bytes(_b64(src, where), where)
    raise ImageError(f"{where}: cannot read an image from {type(src).__name__}")


def _file(s: str) -> Path | None:
    """``s`` as an existing file, or None (base64 data is no file name; a long one is no legal one)."""
    if len(s) > 4096 or "\n" in s:
        return None
    try:
        p = Path(s)
        return p if p.is_file() else None
    except (OSError, ValueError):  # name too long, NUL byte
        return None


def _b64(s: str, where: str) -> bytes:
    try:
        return base64.b64decode(s, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{where}: neither a file, a data URL nor base64 image data") from None


def part_image(part: dict[str, Any]) -> Any | None:
    """The image source of a content part, or None for a text part."""
    if part.get("type") == "image_url" or "image_url" in part:
        url = part.get("image_url")
        return url.get("url") if isinstance(url, dict) else url
    if part.get("type") == "image" or "image" in part:
        return part.get("image")
    return None


def content_images(content: Any) -> list[Any]:
    """The image sources of a message's content (a string has none)."""
    if isinstance(content, str) or content is None:
        return []
    return [s for p in content if (s := part_image(p)) is not None]


def pad_runs(ids: Any, pad: int) -> list[tuple[int, int]]:
    """(start, end) of each run of the token ``pad`` in ``ids`` (an image's placeholder tokens)."""
    import numpy as np

    mask = (np.asarray(ids, dtype=np.int64) == pad).astype(np.int8)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The size the Qwen2-VL image processor resizes to: both sides multiples of ``factor``
    (patch x merge), area within [min_pixels, max_pixels], aspect ratio kept as closely as it can."""
    if max(height, width) / min(height, width) > 200:
        raise ImageError(f"aspect ratio {max(height, width) / min(height, width):.0f}:1 is over 200:1")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


@dataclass(frozen=True)
class VisionSpec:
    """The image geometry of a Qwen2-VL-family model: from its ``preprocessor_config.json``."""

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    max_images: int = 16  # per prompt (SGLang: --limit-mm-data-per-request)

    @classmethod
    def from_folder(cls, path: str | Path) -> VisionSpec | None:
        """The spec of an HF model folder, or None when it has no image processor."""
        f = Path(path) / "preprocessor_config.json"
        if not f.is_file():
            return None
        cfg = json.loads(f.read_text())
        size = cfg.get("size") or {}
        return cls(
            patch_size=int(cfg.get("patch_size", cls.patch_size)),
            merge_size=int(cfg.get("merge_size", cls.merge_size)),
            temporal_patch_size=int(cfg.get("temporal_patch_size", cls.temporal_patch_size)),
            min_pixels=int(cfg.get("min_pixels") or size.get("shortest_edge") or cls.min_pixels),
            max_pixels=int(cfg.get("max_pixels") or size.get("longest_edge") or cls.max_pixels),
            max_images=int(cfg.get("agent_r1_max_images", cls.max_images)),
        )

    def grid(self, image: Image) -> tuple[int, int, int]:
        """(t, h, w) in patches, as the processor's ``image_grid_thw``."""
        h, w = smart_resize(
            image.height, image.width, self.patch_size * self.merge_size, self.min_pixels, self.max_pixels
        )
        return 1, h // self.patch_size, w // self.patch_size

    def num_tokens(self, image: Image) -> int:
        """How many ``<|image_pad|>`` tokens the image becomes (one per merged patch)."""
        t, h, w = self.grid(image)
        return t * h * w // (self.merge_size**2)
