"""visual_arithmetic: the number is only in the picture; demonstrations replay to full reward
through the recipe's own agent on a vision model, the image in the observation."""

import asyncio
import io
import random

import pytest
from scripted import ScriptedPolicy

from agent_r1.agent.chat import ChatCodec
from agent_r1.agent.flow import AGENTS, FlowConfig
from agent_r1.agent_tools.calculator import evaluate
from agent_r1.vision.images import load_image
from recipes import load_recipe

data = load_recipe("visual_arithmetic").data


def _pixels(png: bytes):
    from PIL import Image

    return Image.open(io.BytesIO(png)).convert("L")


def test_problems_are_exact_and_the_text_never_states_the_number():
    rng = random.Random(0)
    for _ in range(300):
        p = data.make_problem(rng)
        assert evaluate(p.expression) == p.answer >= 1 and p.expression.startswith(str(p.number))
        assert str(p.number) not in p.question.split(" Then ")[0]


def test_the_picture_shows_the_digits():
    """Seven segments: each digit lights exactly its segments (read back from the pixels)."""
    for n in (10, 23, 47, 58, 69, 88, 91):
        png = data.render_number(n, random.Random(n))
        im = load_image(png)
        assert (im.format, im.width, im.height) == ("PNG", 56, 56)
        g = _pixels(png)
        for i, digit in enumerate((n // 10, n % 10)):

            def dark(x, y, g=g, i=i):
                return g.getpixel((i * 28 + x, y)) < 128

            # probe each segment near its centre (jitter is at most 2 px, strokes at least 3 px)
            probes = {
                "a": (14, 5),
                "d": (14, 50),
                "g": (14, 28),
                "f": (5, 16),
                "b": (22, 16),
                "e": (5, 40),
                "c": (22, 40),
            }
            lit = {
                s
                for s, (x, y) in probes.items()
                if any(dark(x + dx, y + dy) for dx in (-2, 0, 2) for dy in (-2, 0, 2))
            }
            assert lit == set(data.DIGIT_SEGMENTS[digit]), (n, digit, lit)
    with pytest.raises(ValueError, match="two-digit"):
        data.render_number(7, random.Random(0))


def test_rows_are_chat_messages_with_an_image_part_and_splits_are_disjoint():
    rows = data.build_rows("train", 40, seed=0)
    content = rows[0].prompt[1]["content"]
    assert [p["type"] for p in content] == ["text", "image"] and content[1]["image"].startswith(
        "data:image/png;base64,"
    )
    assert load_image(content[1]["image"]).width == 56
    key = [r.prompt[1]["content"][1]["image"] for r in rows]
    assert key == [r.prompt[1]["content"][1]["image"] for r in data.build_rows("train", 40, seed=0)]
    assert not set(key) & {r.prompt[1]["content"][1]["image"] for r in data.build_rows("test", 40, seed=0)}
    with pytest.raises(ValueError, match="split"):
        data.build_rows("dev", 2)


def test_demonstrations_replay_to_full_reward_on_a_vision_model(tiny_vl_dir):
    codec = ChatCodec.load(str(tiny_vl_dir))
    rows = data.build_rows("test", 6, seed=2)
    demos = data.demonstrations(rows, seed=1, tool_rate=0.5)
    assert {len(d) for d in demos} == {1, 2}  # both branches of the noisy demonstrator
    for row, demo in zip(rows, demos, strict=True):
        policy = ScriptedPolicy(codec, list(demo))
        flow = AGENTS.get(row.agent_name).build(policy, codec, FlowConfig(max_action_tokens=300))
        traj = asyncio.run(flow.run(row, "t", "g"))
        image = load_image(row.prompt[1]["content"][1]["image"])
        assert all(s.images == [image.hash] for s in traj.steps)  # every observation shows the picture
        assert traj.steps[0].image_data == {image.hash: image.data}  # stored once, with the first step
        assert all(not s.image_data for s in traj.steps[1:])
        assert [len(call) for call in policy.images] == [1] * len(demo)
        assert traj.metrics["success"] == (1.0 if len(demo) == 2 else 0.0)
