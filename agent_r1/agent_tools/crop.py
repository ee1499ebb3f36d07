"""Tools over the episode's images: ``ImageTool`` sees them (the environment keeps its list
current), ``crop`` cuts a box out of one and returns it enlarged, as a new image in the result."""

from __future__ import annotations

from typing import Any

from agent_r1.agent_tools.base import TOOLS, BaseTool, ToolError, ToolOutput
from agent_r1.vision.images import Image


class ImageTool(BaseTool):
    """A tool that reads the images the policy has seen in this episode (prompt and tool results,
    in order); ``ToolEnv`` sets ``images`` before every step."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.images: list[Image] = []


@TOOLS.register("crop")
class Crop(ImageTool):
    name = "crop"
    description = (
        "Cut a box out of an image you have seen and look at it enlarged. The box is "
        "[left, top, right, bottom] as fractions (0 to 1) of the image's width and height."
    )
    parameters = {
        "type": "object",
        "properties": {
            "box": {"type": "array", "items": {"type": "number"}, "minItems": 4, "maxItems": 4},
            "image": {"type": "integer", "description": "which image, 1 = the first (default: the latest)"},
        },
        "required": ["box"],
    }
    ZOOM = 2  # the crop comes back twice as large, at most 1024 pixels on a side

    async def execute(self, args: dict[str, Any]) -> ToolOutput:
        if not self.images:
            raise ToolError("there is no image to crop")
        i = int(args.get("image", len(self.images)))
        if not 1 <= i <= len(self.images):
            raise ToolError(f"image must be 1..{len(self.images)}, got {i}")
        left, top, right, bottom = (float(x) for x in args["box"])
        if not (0 <= left < right <= 1 and 0 <= top < bottom <= 1):
            raise ToolError(
                "box must be [left, top, right, bottom] with 0 <= left < right <= 1, 0 <= top < bottom <= 1"
            )
        im = self.images[i - 1].to_pil()
        w, h = im.size
        box = (
            int(left * w),
            int(top * h),
            max(int(left * w) + 1, round(right * w)),
            max(int(top * h) + 1, round(bottom * h)),
        )
        part = im.crop(box)
        scale = min(self.ZOOM, 1024 / max(part.size))
        part = part.resize((max(1, round(part.width * scale)), max(1, round(part.height * scale))))
        out = Image.from_pil(part, "crop")
        return ToolOutput(
            f"image {i}, box {list(box)} ({out.width}x{out.height}):",
            info={"image": i, "box": list(box)},
            images=[out],
        )
