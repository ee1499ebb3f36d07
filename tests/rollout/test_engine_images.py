"""The embedded engine on a Qwen2-VL-family model: images through SGLang's ``image_data``.

References are transformers' own model: ``Qwen2VLForConditionalGeneration`` run teacher-forced on
the prompt and the sampled tokens, with the pixel values of its own image processor."""

import asyncio

import pytest
import torch
from rollout_servers import ServerProc, http
from vision import image_bytes

from agent_r1.agent.chat import ChatCodec
from agent_r1.engines.embedded.engine import Engine
from agent_r1.http_service import BadRequest
from agent_r1.rollout.client import RolloutClient
from agent_r1.rollout.protocol import SamplingParams


@pytest.fixture(scope="module")
def vl_codec(tiny_vl_dir):
    return ChatCodec.load(str(tiny_vl_dir))


def _prompt(codec, *images, text="How many bars and"):
    parts = [{"type": "image", "image": images[0]}, {"type": "text", "text": text}]
    parts += [{"type": "image", "image": im} for im in images[1:]] + [{"type": "text", "text": "?"}]
    return codec.encode_chat_images([{"role": "user", "content": parts}])


def hf_logprobs(engine, ids, out_ids, images):
    """Teacher-forced logprobs of ``out_ids`` after ``ids`` by the HF model itself."""
    full = torch.tensor([ids + out_ids])
    kw = {}
    if images:
        pv, grid = engine.vision.pixels(images)
        kw = dict(pixel_values=pv, image_grid_thw=grid, mm_token_type_ids=(full == engine.image_pad_id).int())
    with torch.no_grad():
        logits = engine.model(input_ids=full, **kw).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [float(lp[len(ids) - 1 + i, t]) for i, t in enumerate(out_ids)]


@pytest.mark.parametrize(
    "arch,chunk",
    [("qwen2_vl", 2048), ("qwen2_vl", 7), ("qwen2_5_vl", 7)],
    ids=["whole", "chunked", "qwen2.5-vl"],
)
def test_logprobs_with_images_equal_hf(request, vl_codec, arch, chunk):
    model_dir = request.getfixturevalue("tiny_vl_dir" if arch == "qwen2_vl" else "tiny_vl25_dir")
    eng = Engine(model_dir, max_running=8, max_len=512, prefill_chunk=chunk).start()
    try:
        a, b = image_bytes(90, 60, seed=1), image_bytes(300, 40, seed=2)
        ids1, ims1 = _prompt(vl_codec, a, b)
        ids2, ims2 = _prompt(vl_codec, b, text="Read")
        text_ids = vl_codec.encode_chat([{"role": "user", "content": "Ava has 3 apples."}])
        sp = {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 5, "n": 2}
        batches = [
            eng.make_requests(ids1, sp, return_logprob=True, image_data=[im.base64() for im in ims1]),
            eng.make_requests(ids2, sp, return_logprob=True, image_data=[ims2[0].data_url()]),
            eng.make_requests(text_ids, sp, return_logprob=True),
        ]
        done = []
        for reqs in batches:
            for r in reqs:
                r.on_update = lambda r, fin: fin and done.append(r)
            eng.submit(reqs)
        while len(done) < 6:
            asyncio.run(asyncio.sleep(0.05))
        for reqs, (ids, ims) in zip(batches, [(ids1, ims1), (ids2, ims2), (text_ids, [])], strict=True):
            if ims:  # the rotary layout is transformers' own
                t = torch.tensor([ids])
                _, grid = eng.vision.pixels(ims)
                pos, delta = eng.model.model.get_rope_index(t, (t == eng.image_pad_id).int(), grid)
                assert torch.equal(reqs[0].rope, pos[:, 0]) and reqs[0].rope_delta == int(delta)
            for r in reqs:
                assert len(r.out_ids) == 16
                ref = hf_logprobs(eng, ids, r.out_ids, ims)
                assert max(abs(x - y) for x, y in zip(ref, r.out_logprobs, strict=True)) < 1e-4
        # the prompt's input logprobs (logprob_start_len) through HF's own multimodal forward
        (r,) = eng.generate_sync(ids1, {"max_new_tokens": 1, "temperature": 1.0}, return_logprob=True,
                                 logprob_start_len=0, image_data=[im.base64() for im in ims1])  # fmt: skip
        ref = hf_logprobs(eng, ids1[:1], ids1[1:], [])
        assert r.input_logprobs[0] is None and len(r.input_logprobs) == len(ids1)
        assert sum(abs(x - y) for x, y in zip(ref, r.input_logprobs[1:], strict=True)) > 1e-3  # images matter
        with_images = hf_logprobs(eng, ids1[:1], ids1[1:], ims1)
        assert max(abs(x - y) for x, y in zip(with_images, r.input_logprobs[1:], strict=True)) < 1e-4
    finally:
        eng.stop()


def test_vision_once_and_prefix_keyed_by_image(tiny_vl_dir, vl_codec):
    eng = Engine(tiny_vl_dir, max_running=4, max_len=512).start()
    try:
        a, b, c = image_bytes(90, 60, seed=1), image_bytes(300, 40, seed=2), image_bytes(90, 60, seed=3)
        ids, ims = _prompt(vl_codec, a, b)
        greedy = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
        (r1,) = eng.generate_sync(ids, greedy, image_data=[im.base64() for im in ims])
        assert eng.vision.computed == 2
        # the next step of the same trajectory: the whole earlier prompt + action come from the cache
        step2 = ids + r1.out_ids + vl_codec.encode("\nmore")
        (r2,) = eng.generate_sync(step2, greedy, return_logprob=True, image_data=[im.base64() for im in ims])
        assert (
            r2.cached_tokens == len(ids) + 3 and eng.vision.computed == 2
        )  # (the last action token's KV is new)
        assert (
            max(
                abs(x - y)
                for x, y in zip(hf_logprobs(eng, step2, r2.out_ids, ims), r2.out_logprobs, strict=True)
            )
            < 1e-4
        )
        # another image of the same size: same token ids, but the cache stops at its first pad
        ids3, ims3 = _prompt(vl_codec, c, b)
        assert ids3 == ids
        (r3,) = eng.generate_sync(ids3, greedy, return_logprob=True, image_data=[im.base64() for im in ims3])
        assert r3.cached_tokens == ids.index(eng.image_pad_id) and eng.vision.computed == 3
        assert (
            max(
                abs(x - y)
                for x, y in zip(hf_logprobs(eng, ids3, r3.out_ids, ims3), r3.out_logprobs, strict=True)
            )
            < 1e-4
        )
        # new weights: cached image features are dropped with the KV (checkpoint names accepted)
        eng.update_weights({"visual.merger.mlp.2.bias": torch.full((64,), 0.5)})
        assert not eng.vision.cache and eng.model.model.visual.merger.mlp[2].bias[0] == 0.5
        (r4,) = eng.generate_sync(ids, greedy, return_logprob=True, image_data=[im.base64() for im in ims])
        assert eng.vision.computed == 5 and r4.cached_tokens == 0
        assert (
            max(
                abs(x - y)
                for x, y in zip(hf_logprobs(eng, ids, r4.out_ids, ims), r4.out_logprobs, strict=True)
            )
            < 1e-4
        )
    finally:
        eng.stop()


def test_bad_image_requests(tiny_vl_dir, tiny_model_dir, vl_codec):
    eng = Engine(tiny_vl_dir, max_running=2, max_len=512)
    png = image_bytes(90, 60, seed=1)
    ids, ims = _prompt(vl_codec, png)
    cases = {
        "image_data\\[0\\]: not a readable image": [ims[0].base64()[:40]],
        "image_data\\[0\\]: neither a file": ["@@not base64@@"],
        "do not match": [ims[0].base64(), ims[0].base64()],
        "but no image was sent": [],
        "more than the model's 16 per prompt": [ims[0].base64()] * 17,
        "format GIF is not supported": [
            __import__("base64").b64encode(image_bytes(9, 9, fmt="GIF")).decode()
        ],
    }
    for msg, data in cases.items():
        with pytest.raises(BadRequest, match=msg):
            eng.make_requests(ids, {"max_new_tokens": 2}, image_data=data)
    text = Engine(tiny_model_dir, max_running=2, max_len=256)
    with pytest.raises(BadRequest, match="text-only model"):
        text.make_requests([1, 2, 3], {"max_new_tokens": 2}, image_data=[ims[0].base64()])


def test_server_and_client_with_images(tiny_vl_dir, vl_codec, tmp_path):
    srv = ServerProc(tiny_vl_dir, tmp_path, "vl", "--served-model-name", "vl")
    try:
        png = image_bytes(61, 117, seed=4)
        ids, ims = _prompt(vl_codec, png)
        st, info = http("GET", srv.url + "/model_info")
        assert st == 200 and info["has_image_understanding"] is True and info["model_type"] == "qwen2_vl"
        st, out = http("POST", srv.url + "/generate", {"input_ids": ids, "image_data": "not an image"})
        assert st == 400 and "image_data[0]" in out["error"]["message"]
        client = RolloutClient([srv.url])
        sp = SamplingParams(temperature=1.0, max_new_tokens=8, seed=1)
        c = asyncio.run(client(ids, sp, images=ims))
        eng = Engine(tiny_vl_dir, max_running=1, max_len=512)
        assert (
            max(abs(x - y) for x, y in zip(hf_logprobs(eng, ids, c.token_ids, ims), c.logprobs, strict=True))
            < 1e-4
        )
        # the OpenAI-compatible chat route: image_url parts, the same tokens as /generate
        openai = pytest.importorskip("openai")
        oa = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": ims[0].data_url()}},
                                             {"type": "text", "text": "How many bars and"}, {"type": "text", "text": "?"}]}]  # fmt: skip
        r = oa.chat.completions.create(
            model="vl", messages=msgs, max_tokens=6, temperature=1.0, seed=3, logprobs=True
        )
        assert r.usage.prompt_tokens == len(ids)
        st, g = http("POST", srv.url + "/generate", {"input_ids": ids, "image_data": [ims[0].base64()], "return_logprob": True,
                     "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 3}})  # fmt: skip
        assert st == 200
        got = [t.logprob for t in r.choices[0].logprobs.content]
        want = [lp for lp, _, _ in g["meta_info"]["output_token_logprobs"]]
        assert len(got) == len(want) and max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-5
        with pytest.raises(openai.BadRequestError, match="not a readable image"):
            oa.chat.completions.create(model="vl", messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}], max_tokens=2)  # fmt: skip
        st, _ = http("GET", srv.url + "/health_generate")
        assert st == 200  # bad requests cost nothing
    finally:
        srv.kill()
