"""Images in the agent layer: the Qwen2-VL chat template and pad expansion against transformers'
own processor, image loading and its errors, and images from an environment into step records."""

import asyncio
import hashlib
import io
import subprocess
import sys

import pytest
from scripted import ScriptedPolicy
from vision import hf_processor, image_bytes

from agent_r1.agent.chat import ChatCodec
from agent_r1.agent.env import ENVS, AgentEnv
from agent_r1.agent.flow import AgentEnvLoop, FlowConfig, SingleStepFlow
from agent_r1.agent.types import Observation, StepResult
from agent_r1.agent_tools import TOOLS, BaseTool, ToolOutput
from agent_r1.data.rows import DataRow
from agent_r1.records.schema import records_from_table, records_to_table, table_images
from agent_r1.vision.images import Image, ImageError, VisionSpec, load_image, smart_resize


@pytest.fixture(scope="module")
def vl_codec(tiny_vl_dir):
    return ChatCodec.load(str(tiny_vl_dir))


@pytest.fixture(scope="module")
def processor(tiny_vl_dir):
    return hf_processor(tiny_vl_dir)


def _pil(data: bytes):
    from PIL import Image as PILImage

    return PILImage.open(io.BytesIO(data)).convert("RGB")


# (width, height): inside the limits, under min_pixels (scaled up), over max_pixels (scaled
# down), elongated, and not multiples of 28
SIZES = [(56, 56), (90, 60), (20, 20), (300, 300), (300, 40), (61, 117)]


def _chats(imgs):
    a, b, c = imgs[:3]
    return [
        [{"role": "user", "content": [{"type": "image", "image": a}, {"type": "text", "text": "How many bars?"}]}],
        [
            {"role": "system", "content": "Read the chart."},
            {"role": "user", "content": [{"type": "text", "text": "Compare "}, {"type": "image", "image": a},
                                         {"type": "text", "text": " and "}, {"type": "image", "image": b}]},
        ],
        [
            {"role": "user", "content": [{"type": "image", "image": a}, {"type": "text", "text": "Total?"}]},
            {"role": "assistant", "content": "", "tool_calls": [{"name": "calculator", "arguments": {"expression": "2+3"}}]},
            {"role": "tool", "name": "calculator", "content": [{"type": "text", "text": "5 and the crop:"},
                                                               {"type": "image", "image": c}]},
        ],
    ]  # fmt: skip


@pytest.mark.parametrize("sizes", [SIZES[:3], SIZES[3:]], ids=["small", "large"])
def test_chat_template_and_pads_equal_the_hf_processor(vl_codec, processor, sizes):
    data = [image_bytes(w, h, seed=i) for i, (w, h) in enumerate(sizes)]
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    for msgs in _chats(data):
        ids, images = vl_codec.encode_chat_images(msgs, tools if msgs[-1]["role"] == "tool" else None)
        hf_msgs = [
            {**m, "content": [{**p, "image": _pil(p["image"])} if "image" in p else p for p in m["content"]]}
            if isinstance(m["content"], list) else m
            for m in msgs
        ]  # fmt: skip
        kw = {"tools": tools} if msgs[-1]["role"] == "tool" else {}
        text = processor.apply_chat_template(hf_msgs, tokenize=False, add_generation_prompt=True, **kw)
        pils = [_pil(im.data) for im in images]
        out = processor(text=[text], images=pils, return_tensors="pt")
        assert ids == out["input_ids"][0].tolist()
        assert [vl_codec.vision.grid(im) for im in images] == [
            tuple(g) for g in out["image_grid_thw"].tolist()
        ]
        assert vl_codec.image_pad_runs(ids) == [vl_codec.vision.num_tokens(im) for im in images]
        assert [im.data for im in images] == [d for m in msgs if isinstance(m["content"], list)
                                               for p in m["content"] if "image" in p for d in [p["image"]]]  # fmt: skip


def test_smart_resize_equals_transformers():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_resize

    for h in (1, 13, 28, 55, 56, 57, 100, 333, 1000, 4000):
        for w in (3, 28, 99, 240, 1919):
            if max(h, w) / min(h, w) > 200:
                with pytest.raises(ImageError, match="aspect ratio"):
                    smart_resize(h, w, 28, 3136, 12544)
                continue
            for lo, hi in ((3136, 12544), (3136, 28 * 28 * 1280)):
                assert smart_resize(h, w, 28, lo, hi) == hf_resize(h, w, 28, lo, hi), (h, w, lo, hi)


def test_vision_spec_reads_the_saved_image_processor(tiny_vl_dir):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    spec = VisionSpec.from_folder(tiny_vl_dir)
    hf = Qwen2VLImageProcessorPil.from_pretrained(tiny_vl_dir)
    assert (spec.min_pixels, spec.max_pixels) == (hf.size["shortest_edge"], hf.size["longest_edge"])
    assert (spec.patch_size, spec.merge_size, spec.temporal_patch_size) == (14, 2, 2)
    assert VisionSpec.from_folder(tiny_vl_dir.parent) is None


def test_image_sources_and_hash(tmp_path):
    png = image_bytes(30, 20, seed=3)
    im = load_image(png)
    assert (im.format, im.width, im.height, im.hash) == ("PNG", 30, 20, hashlib.sha256(png).hexdigest())
    (tmp_path / "a.png").write_bytes(png)
    for src in (tmp_path / "a.png", str(tmp_path / "a.png"), im.data_url(), im.base64(), bytearray(png)):
        assert load_image(src).data == png
    # base64 shorter than a path may be but longer than a file name may be (no stat error)
    small = image_bytes(8, 8, seed=1)
    assert (
        255 < len(load_image(small).base64()) < 4096 and load_image(load_image(small).base64()).data == small
    )
    assert load_image(_pil(png)).to_pil().tobytes() == _pil(png).tobytes()  # re-encoded losslessly
    for fmt in ("JPEG", "WEBP"):
        assert load_image(image_bytes(30, 20, fmt=fmt)).format == fmt


def test_bad_images_are_clear_errors(monkeypatch, codec, vl_codec):
    png = image_bytes(40, 40)
    cases = {
        "not a readable image": png[: len(png) // 2],  # truncated
        "format GIF is not supported": image_bytes(10, 10, fmt="GIF"),
        "neither a file, a data URL nor base64": "no such file.png",
        "are not fetched": "https://example.com/a.png",
        "empty image": b"",
        "base64-encoded": "data:image/png,abc",
    }
    for msg, src in cases.items():
        with pytest.raises(ImageError, match=msg):
            load_image(src)
    import agent_r1.vision.images as images_mod

    monkeypatch.setattr(images_mod, "MAX_BYTES", 100)
    with pytest.raises(ImageError, match="more than the 100-byte limit"):
        load_image(png)
    monkeypatch.setattr(images_mod, "MAX_BYTES", 16 << 20)
    monkeypatch.setattr(images_mod, "MAX_DECODED_PIXELS", 1000)
    with pytest.raises(ImageError, match="40x40 pixels"):
        load_image(png)
    monkeypatch.setattr(images_mod, "MAX_DECODED_PIXELS", 64 << 20)

    part = [{"type": "image", "image": png}, {"type": "text", "text": "hi"}]
    with pytest.raises(ImageError, match="text-only model"):
        codec.encode_chat_images([{"role": "user", "content": part}])
    with pytest.raises(ImageError, match="encode_chat_images"):
        vl_codec.encode_chat([{"role": "user", "content": part}])
    too_many = [{"type": "image", "image": png}] * (vl_codec.vision.max_images + 1)
    with pytest.raises(ImageError, match="more than 16 images"):
        vl_codec.encode_chat_images([{"role": "user", "content": too_many}])
    with pytest.raises(ImageError, match="message 1, part 0: not a readable image"):
        vl_codec.encode_chat_images(
            [{"role": "system", "content": "s"}, {"role": "user", "content": [{"image": b"xx"}]}]
        )
    with pytest.raises(ValueError, match="neither a text nor an image part"):
        vl_codec.encode_chat_images([{"role": "user", "content": [{"type": "audio"}]}])
    # an environment's token-id observation whose pads do not fit its images
    ids, imgs = vl_codec.encode_chat_images([{"role": "user", "content": part}])
    pad = ids.index(vl_codec.image_token_id())
    for bad_ids, bad_imgs in ((ids, imgs + imgs), (ids[:pad] + ids[pad + 1 :], imgs), (ids, [])):
        with pytest.raises(ImageError, match="do not match"):
            vl_codec.check_image_pads(bad_ids, bad_imgs)
    vl_codec.check_image_pads(ids, imgs)


# ---- from an environment into step records ------------------------------------------------------
class Looker(AgentEnv):
    """Shows an image, then (a "zoom") a second one next to the first; done after two steps."""

    def __init__(self, codec, **kw):
        super().__init__(codec, **kw)
        self.first, self.second = image_bytes(90, 60, seed=1), image_bytes(60, 120, seed=2)

    def reset(self, **row):
        self.msgs = [{"role": "user", "content": [{"type": "image", "image": self.first},
                                                  {"type": "text", "text": "What is shown?"}]}]  # fmt: skip
        return Observation(messages=self.msgs)

    async def step(self, action):
        if len(self.msgs) > 1:
            return StepResult(None, 1.0, True)
        self.msgs = [*self.msgs, {"role": "assistant", "content": action.text},
                     {"role": "user", "content": [{"type": "text", "text": "zoomed:"}, {"type": "image", "image": self.second}]}]  # fmt: skip
        return StepResult(Observation(messages=self.msgs), 0.0, False)


ENVS.register("test_looker")(Looker)


def test_env_images_reach_generate_and_records_once(vl_codec, tmp_path):
    policy = ScriptedPolicy(vl_codec, ["bars", "two bars"])
    flow = AgentEnvLoop(policy, vl_codec, FlowConfig(max_action_tokens=50), env="test_looker")
    row = DataRow(
        prompt=[], agent_name="t", reward_model={"style": "math_number", "ground_truth": "1"}, data_source="t"
    )
    traj = asyncio.run(flow.run(row, "t0", "g0"))
    first, second = (load_image(d) for d in (image_bytes(90, 60, seed=1), image_bytes(60, 120, seed=2)))
    assert [[im.hash for im in call] for call in policy.images] == [[first.hash], [first.hash, second.hash]]
    s0, s1 = traj.steps
    assert s0.images == [first.hash] and s0.image_data == {first.hash: first.data}
    assert s1.images == [first.hash, second.hash] and s1.image_data == {
        second.hash: second.data
    }  # stored once
    assert vl_codec.image_pad_runs(s1.obs_token_ids) == [
        vl_codec.vision.num_tokens(i) for i in (first, second)
    ]
    assert s1.prefix_len == len(s0.obs_token_ids) + len(s0.action_token_ids)  # the image prefix is kept

    # shard write / read: the bytes come back bit-identical, zero-copy
    from agent_r1.records.reader import RecordStore
    from agent_r1.records.shard import finalize_iteration, write_shard

    text_only = records_to_table([type(s0)("t1", "g0", 0, [1, 2], [3], [-0.1], [1])])
    write_shard(tmp_path, 0, 0, records_to_table(traj.steps))
    write_shard(tmp_path, 0, 1, text_only)  # a writer whose trajectories had no image
    finalize_iteration(tmp_path, 0)
    table = RecordStore(tmp_path).read(0)
    stored = table_images(table)
    assert {h: bytes(b) for (_, h), b in stored.items()} == {first.hash: first.data, second.hash: second.data}
    assert all(b.address != 0 for b in stored.values())
    back = [r for r in records_from_table(table) if r.trajectory_id == "t0"]
    assert [(r.images, r.image_data) for r in back] == [(s.images, s.image_data) for s in traj.steps]
    assert [r.images for r in records_from_table(table) if r.trajectory_id == "t1"] == [[]]

    out = subprocess.run(
        [sys.executable, "-m", "agent_r1.cli", "records", "show", str(tmp_path), "--trajectory", "t0"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    shown = [line for line in out.splitlines() if line.startswith("[images]")]
    kib = [f"{len(im.data) / 1024:.1f} KiB" for im in (first, second)]
    assert shown == [
        f"[images] 1: {first.hash[:12]} ({kib[0]}, stored here)",
        f"[images] 2: {first.hash[:12]} ({kib[0]}), {second.hash[:12]} ({kib[1]}, stored here)",
    ]


def test_single_step_row_with_an_image(vl_codec):
    png = image_bytes(56, 56, seed=4)
    row = DataRow(
        prompt=[
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": load_image(png).data_url()},
                    {"type": "text", "text": "Count."},
                ],
            }
        ],  # fmt: skip
        agent_name="single_step",
        reward_model={"style": "math_number", "ground_truth": "3"},
        data_source="t",
    )
    policy = ScriptedPolicy(vl_codec, ["3"])
    traj = asyncio.run(SingleStepFlow(policy, vl_codec).run(row, "t", "g"))
    h = hashlib.sha256(png).hexdigest()
    assert traj.steps[0].images == [h] and traj.steps[0].image_data == {h: png}
    assert [im.hash for im in policy.images[0]] == [h]


def test_corrupt_stored_image_is_named():
    png = image_bytes(20, 20)
    h = hashlib.sha256(png).hexdigest()
    from agent_r1.records.schema import StepRecord

    t = records_to_table(
        [StepRecord("t", "g", 0, [1], [2], [-0.1], [1], images=[h], image_data={h: png[:-1] + b"x"})]
    )
    with pytest.raises(ValueError, match=f"image {h[:12]}'s bytes do not match its hash"):
        table_images(t)
    t = records_to_table([StepRecord("t", "g", 0, [1], [2], [-0.1], [1], images=[h])])
    with pytest.raises(ValueError, match="is not stored in the trajectory"):
        table_images(t)
    with pytest.raises(ValueError, match="which its observation does not show"):
        StepRecord("t", "g", 0, [1], [2], [-0.1], [1], image_data={h: png})
    assert Image.from_bytes(png).hash == h


def test_a_tool_returns_an_image_and_the_next_observation_shows_it(vl_codec, codec):
    """``crop`` over the prompt's picture: the crop comes back in the tool turn (vision markup,
    pads expanded), the flow passes both images to generate, the records store each once."""
    from agent_r1.agent.tool_calls import format_tool_call

    png = image_bytes(112, 56, seed=7)
    row = DataRow(
        prompt=[{"role": "user", "content": [{"type": "image", "image": png}, {"type": "text", "text": "Zoom."}]}],
        agent_name="t", reward_model={"style": "math_number", "ground_truth": "1"}, data_source="t",
    )  # fmt: skip
    calls = [
        format_tool_call("crop", {"box": [0.5, 0.0, 1.0, 1.0]}),
        format_tool_call("crop", {"box": [0.2, 0.2, 0.1, 0.9]}),  # a bad box: error feedback
        "The answer is \\boxed{1}.",
    ]
    policy = ScriptedPolicy(vl_codec, calls)
    flow = AgentEnvLoop(policy, vl_codec, FlowConfig(max_action_tokens=80), env="tool", tools=["crop"])
    traj = asyncio.run(flow.run(row, "t0", "g0"))
    first = load_image(png)
    s0, s1, s2 = traj.steps
    assert s0.feedback.startswith("<tool_response>\nimage 1, box [56, 0, 112, 56] (112x112):")
    assert "<|image_pad|>" not in s0.feedback and s0.info["tool_calls"][0]["images"] == 1
    crop_hash = s1.images[1]
    assert s1.images[0] == first.hash and s1.image_data.keys() == {crop_hash}
    crop = load_image(s1.image_data[crop_hash])
    from PIL import Image as PILImage

    want = first.to_pil().crop((56, 0, 112, 56)).resize((112, 112), PILImage.Resampling.BICUBIC)
    assert crop.to_pil().tobytes() == want.tobytes()
    assert vl_codec.image_pad_runs(s1.obs_token_ids) == [
        vl_codec.vision.num_tokens(im) for im in (first, crop)
    ]
    assert "box must be" in s1.feedback and s2.images == s1.images and not s2.image_data
    assert [len(x) for x in policy.images] == [1, 2, 2]
    # a text-only model is told, and never sent, the crop
    text_row = DataRow(prompt=[{"role": "user", "content": "Zoom."}], agent_name="t",
                       reward_model={"style": "math_number", "ground_truth": "1"}, data_source="t")  # fmt: skip
    policy = ScriptedPolicy(codec, [calls[0], format_tool_call("picture", {}), calls[2]])
    flow = AgentEnvLoop(
        policy, codec, FlowConfig(max_action_tokens=80), env="tool", tools=["crop", "picture"]
    )
    traj = asyncio.run(flow.run(text_row, "t1", "g1"))
    assert "there is no image to crop" in traj.steps[0].feedback
    assert not any(s.images for s in traj.steps) and "not shown" in codec.decode(traj.steps[2].obs_token_ids)


class Picture(BaseTool):
    name = "picture"

    async def execute(self, args):
        return ToolOutput("here:", images=[load_image(image_bytes(20, 20))])


TOOLS.register("picture")(Picture)


def test_a_sampled_image_pad_ends_the_episode_and_stays_text(vl_codec, tiny_vl_dir):
    """A (random) vision model may sample ``<|image_pad|>``: shown again it would read as an image,
    so the episode ends at that step; the learner treats the sampled pads as text."""
    from agent_r1.learner.batch import LearnerBatch
    from agent_r1.vision.qwen2_vl import Geometry

    policy = ScriptedPolicy(vl_codec, ["I see <|image_pad|><|image_pad|> here", "never asked"])
    flow = AgentEnvLoop(policy, vl_codec, FlowConfig(max_action_tokens=50), env="test_looker")
    row = DataRow(
        prompt=[], agent_name="t", reward_model={"style": "math_number", "ground_truth": "1"}, data_source="t"
    )
    traj = asyncio.run(flow.run(row, "t0", "g0"))
    (s0,) = traj.steps
    assert s0.done and s0.truncated and traj.metrics["vision_token_sampled"] == 1.0
    assert vl_codec.image_token_id() in s0.action_token_ids and len(policy.calls) == 1
    geometry = Geometry.of(tiny_vl_dir)
    b = LearnerBatch.from_table(records_to_table(traj.steps), vision=geometry)
    (mb,) = b.micro_batches(None, 10_000)
    pads = [int(p) for p in mb.image_pos]
    assert len(pads) == vl_codec.vision.num_tokens(load_image(image_bytes(90, 60, seed=1)))
    assert all(p < len(s0.obs_token_ids) for p in pads)  # the observation's, not the action's
    assert mb.positions.shape == (3, len(s0.obs_token_ids) + len(s0.action_token_ids))
