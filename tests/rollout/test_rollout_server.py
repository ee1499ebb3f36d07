"""Real servers on loopback: SGLang's /generate schema and control endpoints, the real
sglang-router in front of two embedded servers, client retries, weight updates over gloo and disk."""

import asyncio
import json
import math
import threading
import time
from pathlib import Path

import pytest
import torch
from rollout_servers import RouterProc, ServerProc, http
from scripted import ScriptedPolicy  # noqa: F401  (keeps test helpers importable together)

from agent_r1.agent.flow import AGENTS, FlowConfig
from agent_r1.agent.run_episodes import run_episodes
from agent_r1.http_service import published_urls
from agent_r1.rollout.client import RequestRejected, RolloutClient, RolloutError
from agent_r1.rollout.protocol import FinishReason, SamplingParams
from agent_r1.weights.disk import push_weights_from_disk
from agent_r1.weights.sglang import WeightUpdateGroup
from agent_r1.weights.transport import WeightSyncError


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    servers = [ServerProc(tiny_model_dir, run_dir, f"s{i}") for i in range(2)]
    yield run_dir, servers
    for s in servers:
        s.kill()


def gen(url, body, timeout=60):
    return http("POST", url + "/generate", body, timeout)


def test_generate_schema(cluster, codec):
    _, (s, _) = cluster
    ids = codec.encode_chat([{"role": "user", "content": "Ava has 3 apples."}])
    st, out = gen(
        s.url,
        {
            "input_ids": ids,
            "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True},
            "return_logprob": True,
            "rid": "r1",
        },
    )
    assert st == 200 and set(out) >= {"text", "output_ids", "meta_info", "index"}
    m = out["meta_info"]
    assert m["id"] == "r1" and m["finish_reason"] == {"type": "length", "length": 6}
    assert m["prompt_tokens"] == len(ids) and m["completion_tokens"] == 6 and m["weight_version"] == "default"
    assert [t[1] for t in m["output_token_logprobs"]] == out["output_ids"] and all(
        t[0] <= 0 for t in m["output_token_logprobs"]
    )
    assert m["e2e_latency"] > 0 and "cached_tokens" in m
    # batch of prompts and n > 1 answer arrays with indices
    st, outs = gen(s.url, {"input_ids": [ids, ids[:5]], "sampling_params": {"max_new_tokens": 2}})
    assert st == 200 and [o["index"] for o in outs] == [0, 1]
    st, outs = gen(s.url, {"text": "Ava has", "sampling_params": {"max_new_tokens": 2, "n": 3}})
    assert st == 200 and len(outs) == 3
    # prompt logprobs and top logprobs
    st, out = gen(
        s.url,
        {
            "input_ids": ids[:6],
            "sampling_params": {"max_new_tokens": 2},
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 3,
        },
    )
    assert (
        out["meta_info"]["input_token_logprobs"][0][0] is None
        and len(out["meta_info"]["input_token_logprobs"]) == 6
    )
    assert all(len(t) == 3 for t in out["meta_info"]["output_top_logprobs"])


def test_streaming_sse(cluster):
    _, (s, _) = cluster
    import urllib.request

    req = urllib.request.Request(
        s.url + "/generate",
        data=json.dumps(
            {
                "input_ids": [1, 2, 3],
                "sampling_params": {"max_new_tokens": 4, "ignore_eos": True},
                "stream": True,
            }
        ).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = [line[6:] for line in r.read().decode().split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3, 4]  # cumulative
    assert (
        chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
        and chunks[0]["meta_info"]["finish_reason"] is None
    )


@pytest.mark.parametrize(
    "body,msg",
    [
        (b"{not json", "not JSON"),
        ({"input_ids": []}, "input_ids"),
        ({"input_ids": [10**8]}, "outside the vocabulary"),
        ({"input_ids": [1], "text": "x"}, "exactly one of text / input_ids"),
        ({"input_ids": [5] * 1100}, "context length"),
        ({"input_ids": [1], "sampling_params": {"temprature": 1}}, "unknown field `temprature`"),
        ({"input_ids": [1], "sampling_params": {"top_p": 2}}, "sampling_params.top_p"),
        ({"input_ids": [1], "top_logprobs_num": -1}, "top_logprobs_num"),
        ({"input_ids": [True, False]}, "outside the vocabulary"),  # JSON booleans are not token ids
        (b'{"input_ids": [1], "sampling_params": {"temperature": NaN}}', "sampling_params.temperature"),
        (b'{"input_ids": [1], "sampling_params": {"top_p": Infinity}}', "sampling_params.top_p"),
        ({"input_ids": [1], "sampling_params": "ab"}, "sampling_params: must be an object"),
        ({"input_ids": [1], "sampling_params": {"sampling_seed": 2**70}}, "sampling_params.sampling_seed"),
        ({"input_ids": [1], "sampling_params": {"stop_token_ids": [True]}}, "sampling_params.stop_token_ids"),
        ({"input_ids": [1], "rid": 5}, "rid: must be a string"),
        (b'{"input_ids": [1], "text": "\xff"}', "not UTF-8"),
        (b'{"input_ids": [1], "sampling_params": {"temperature": 1e400}}', "sampling_params.temperature"),
    ],
)
def test_bad_requests_answer_400_and_server_keeps_serving(cluster, body, msg):
    _, (s, _) = cluster
    st, out = gen(s.url, body)
    assert st == 400 and msg in out["error"]["message"]
    assert gen(s.url, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})[0] == 200


def test_vanishing_temperature_is_greedy_with_finite_logprobs(cluster):
    _, (s, _) = cluster
    body = {"input_ids": [1, 2, 3], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}}  # fmt: skip
    tiny = gen(s.url, {**body, "sampling_params": {**body["sampling_params"], "temperature": 1e-300}})
    greedy = gen(s.url, {**body, "sampling_params": {**body["sampling_params"], "temperature": 0}})
    assert tiny[0] == greedy[0] == 200
    assert tiny[1]["output_ids"] == greedy[1]["output_ids"]
    lps = [x[0] for x in tiny[1]["meta_info"]["output_token_logprobs"]]
    assert all(math.isfinite(x) for x in lps)


def test_info_health_loads_flush(cluster):
    _, (s, _) = cluster
    assert http("GET", s.url + "/health")[0] == 200
    assert http("GET", s.url + "/health_generate")[0] == 200
    info = http("GET", s.url + "/get_server_info")[1]
    assert info["dp_size"] == 1 and info["max_total_num_tokens"] == 16 * 1024 and "model_path" in info
    assert http("GET", s.url + "/get_model_info")[1]["model_type"] == "qwen3"
    loads = http("GET", s.url + "/v1/loads?include=core")[1]["loads"][0]
    assert {"num_running_reqs", "num_waiting_reqs", "num_used_tokens", "token_usage"} <= set(loads)
    assert http("POST", s.url + "/flush_cache")[0] == 200
    assert http("POST", s.url + "/release_memory_occupation", {})[0] == 200


def generated(url) -> int:
    return http("GET", url + "/get_server_info")[1]["internal_states"][0]["generated_tokens"]


def wait_decoding(url, before: int, timeout: float = 30) -> None:
    """Until the server has sampled a token past ``before``: a request is decoding (a fixed sleep
    raced the tiny model, which samples 900 tokens in about 0.3 s)."""
    end = time.time() + timeout
    while generated(url) <= before:
        assert time.time() < end, "no token sampled"
        time.sleep(0.002)


def caught_midway(url: str, interrupt, after=lambda: None) -> dict:
    """A 900-token request (rid ``slow``) ``interrupt``-ed once it decodes, then ``after()``. The
    tiny model samples 900 tokens in about 0.3 s, so on a busy machine one can end before the
    interrupt lands: then another is started, until one is caught mid-way (a guard of 120 s
    against a hang)."""
    long = {
        "input_ids": [1, 2, 3],
        "rid": "slow",
        "sampling_params": {"max_new_tokens": 900, "ignore_eos": True},
    }
    deadline = time.time() + 120
    while True:
        box = {}
        before = generated(url)
        t = threading.Thread(target=lambda b=box: b.update(r=gen(url, long)))
        t.start()
        wait_decoding(url, before)
        interrupt()
        t.join(60)
        after()
        st, out = box["r"]
        assert st == 200, out
        if out["meta_info"]["finish_reason"]["type"] == "abort":
            return out
        assert time.time() < deadline, "every request finished before its interrupt"


def test_abort_and_pause_over_http(cluster):
    _, (s, _) = cluster

    def loads() -> dict:
        return http("GET", s.url + "/v1/loads")[1]["loads"][0]

    def resume() -> None:
        assert http("POST", s.url + "/continue_generation", {})[0] == 200

    try:
        out = caught_midway(s.url, lambda: http("POST", s.url + "/abort_request", {"rid": "slow"}))
        assert 0 < len(out["output_ids"]) < 900
        # in_place pause: a new request waits until continue, nothing sampled for it meanwhile
        assert http("POST", s.url + "/pause_generation", {"mode": "in_place"})[1]["status"] == "ok"
        box = {}
        before = generated(s.url)
        t = threading.Thread(
            target=lambda: box.update(
                p=gen(s.url, {"input_ids": [5], "sampling_params": {"max_new_tokens": 2}})
            )
        )
        t.start()
        deadline = time.time() + 60
        while loads()["num_waiting_reqs"] + loads()["num_running_reqs"] == 0:  # it has arrived
            assert time.time() < deadline, "the request never reached the engine"
            time.sleep(0.01)
        assert "p" not in box and generated(s.url) == before
        resume()
        t.join(30)
        assert box["p"][0] == 200
        assert http("POST", s.url + "/pause_generation", {"mode": "sideways"})[0] == 400
        # abort mode: in-flight requests come back aborted, with what they had sampled
        pause = {"mode": "abort"}
        out = caught_midway(s.url, lambda: http("POST", s.url + "/pause_generation", pause), resume)
        assert 0 < len(out["output_ids"]) < 900
    finally:  # the next tests share this server: never leave it paused
        resume()


def test_router_in_front_of_two_servers(cluster, tmp_path):
    run_dir, servers = cluster
    router = RouterProc(tmp_path)
    try:
        for s in servers:
            router.register(s.url)
        before = [
            http("GET", s.url + "/get_server_info")[1]["internal_states"][0]["generated_tokens"]
            for s in servers
        ]
        client = RolloutClient(router=router.url)

        async def go():
            try:
                await client.wait_ready(30)
                assert sorted(await client.workers()) == sorted(s.url for s in servers)
                outs = await asyncio.gather(
                    *(
                        client([1, 2, 3 + i], SamplingParams(temperature=0, max_new_tokens=4))
                        for i in range(8)
                    )
                )
                await client.abort()  # reaches every worker via the router's list
                return outs
            finally:
                await client.close()

        outs = asyncio.run(go())
        assert all(len(o.token_ids) <= 4 and o.logprobs for o in outs)
        after = [
            http("GET", s.url + "/get_server_info")[1]["internal_states"][0]["generated_tokens"]
            for s in servers
        ]
        assert all(a > b for a, b in zip(after, before, strict=True))  # both workers served
    finally:
        router.kill()


def test_client_retries_on_a_killed_server_and_rejects_bad_requests(cluster, tiny_model_dir, tmp_path):
    run_dir, (s0, _) = cluster
    doomed = ServerProc(tiny_model_dir, tmp_path, "doomed")
    doomed.kill()
    client = RolloutClient(servers=[doomed.url, s0.url], max_retries=3)

    async def go():
        try:
            outs = [
                await client([1, 2, 3], SamplingParams(temperature=0, max_new_tokens=3)) for _ in range(3)
            ]
            with pytest.raises(RequestRejected, match="unknown field"):
                await client.generate_raw({"input_ids": [1], "sampling_params": {"bogus": 1}})
            return outs
        finally:
            await client.close()

    outs = asyncio.run(go())
    assert all(o.finish_reason in (FinishReason.LENGTH, FinishReason.STOP) for o in outs)
    assert client.down_until.get(doomed.url, 0) > 0
    dead_only = RolloutClient(servers=[doomed.url], max_retries=2)

    async def fail():
        try:
            await dead_only([1], SamplingParams(max_new_tokens=1))
        finally:
            await dead_only.close()

    with pytest.raises(
        RolloutError,
        match="generate failed on every server tried: http://127.0.0.1:\\d+: ClientConnectorError",
    ):
        asyncio.run(fail())
    assert len(published_urls(Path(run_dir) / "control" / "servers")) == 2


def test_seeded_sampling_reproducible_over_http(cluster):
    _, (s0, s1) = cluster
    body = {
        "input_ids": [1, 2, 3, 4],
        "sampling_params": {
            "temperature": 1.0,
            "max_new_tokens": 12,
            "sampling_seed": 42,
            "ignore_eos": True,
        },
    }
    a, b = gen(s0.url, body)[1], gen(s1.url, body)[1]
    assert a["output_ids"] == b["output_ids"]


def test_weight_update_over_gloo_and_disk(cluster, tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    _, servers = cluster
    urls = [s.url for s in servers]
    original = load_file(str(tiny_model_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    changed = {
        n: (t + 0.05 * torch.randn(t.shape, generator=g)) if t.dim() == 2 else t for n, t in original.items()
    }
    body = {
        "input_ids": [1, 2, 3, 4],
        "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True},
        "return_logprob": True,
    }
    before = [gen(u, body)[1] for u in urls]

    async def push(tensors, version):
        group = WeightUpdateGroup(urls)
        await group.init()
        try:
            return await group.push(tensors.items(), version, bucket_bytes=64 * 1024)  # several buckets
        finally:
            await group.close()

    seconds = asyncio.run(push(changed, 5))
    assert seconds > 0
    after = [gen(u, body)[1] for u in urls]
    assert all(a["meta_info"]["weight_version"] == "5" for a in after)
    assert after[0]["meta_info"]["output_token_logprobs"] != before[0]["meta_info"]["output_token_logprobs"]
    name = next(n for n, t in changed.items() if t.dim() == 2)
    got = http("POST", urls[1] + "/get_weights_by_name", {"name": name, "truncate_size": 5})[1]
    assert got == pytest.approx(changed[name].flatten()[:5].tolist(), abs=1e-6)
    # a server that does not have the version is reported and taken out of the generating client
    client = RolloutClient(servers=urls)

    async def check_verify():
        group = WeightUpdateGroup(urls, rollout_client=client)
        http("POST", urls[1] + "/update_weight_version", {"new_version": "stale"})
        with pytest.raises(WeightSyncError, match="servers without weight version 5"):
            await group.verify(5)
        assert client.disabled == {urls[1]}
        outs = [await client([1, 2], SamplingParams(max_new_tokens=1)) for _ in range(3)]
        http("POST", urls[1] + "/update_weight_version", {"new_version": "5"})
        await group.verify(5)
        assert client.disabled == set()
        await client.close()
        await group.client.close()
        return outs

    assert len(asyncio.run(check_verify())) == 3
    asyncio.run(push_weights_from_disk(urls, original.items(), tmp_path / "weights" / "v6", 6))
    restored = [gen(u, body)[1] for u in urls]
    assert all(r["meta_info"]["weight_version"] == "6" for r in restored)
    assert restored[0]["output_ids"] == before[0]["output_ids"]
    assert [t[0] for t in restored[1]["meta_info"]["output_token_logprobs"]] == pytest.approx(
        [t[0] for t in before[1]["meta_info"]["output_token_logprobs"]], abs=1e-6
    )


def test_agent_flows_run_through_the_client(cluster, codec):
    _, servers = cluster
    from recipes import load_recipe

    rows = load_recipe("arithmetic_tool").build_rows("test", 4, seed=0)
    client = RolloutClient(servers=[s.url for s in servers])

    async def go():
        try:
            return await run_episodes(
                rows,
                client,
                codec,
                FlowConfig(max_action_tokens=16, sampling=SamplingParams(temperature=1.0, seed=3)),
                group_size=2,
                progress=False,
            )
        finally:
            await client.close()

    trajs = asyncio.run(go())
    version = http("GET", servers[0].url + "/get_weight_version")[1]["weight_version"]
    assert len(trajs) == 8 and all(t.steps for t in trajs)
    for t in trajs:
        s = t.steps[0]
        assert len(s.action_token_ids) == len(s.action_logprobs) <= 16
        assert s.policy_version == (int(version) if version.isdigit() else 0)
    assert len(client.sticky) == 8  # one sticky server per trajectory
    assert "arithmetic_tool" in AGENTS


def test_greedy_over_http_equals_transformers(cluster, tiny_model_dir, codec):
    from transformers import AutoModelForCausalLM

    _, (s0, _) = cluster
    version = http("GET", s0.url + "/get_weight_version")[1]["weight_version"]
    if version not in ("default", "6"):  # weights restored to the originals by the weight test
        pytest.skip(f"server weights changed by another test (version {version})")
    prompt = codec.encode_chat(
        [{"role": "user", "content": "Gus has 12 shells. Then Gus finds 5 more shells."}]
    )
    st, out = gen(
        s0.url,
        {
            "input_ids": prompt,
            "sampling_params": {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True},
        },
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ref = model.generate(
        torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    assert st == 200 and out["output_ids"] == ref[0, len(prompt) :].tolist()


def test_weight_update_through_shared_memory_ipc(cluster, tiny_model_dir, tmp_path):
    """``/update_weights_from_tensor`` (SGLang's colocated path): the tensors travel as handles the
    server maps (CUDA IPC on a GPU, shared memory here), and only to a server started with
    ``--weight-ipc`` (the body is unpickled)."""
    import torch.multiprocessing as mp
    from safetensors.torch import load_file

    from agent_r1.weights.sglang import push_weights_ipc

    _, (plain, _) = cluster
    original = load_file(str(tiny_model_dir / "model.safetensors"))
    changed = {n: t + 0.25 for n, t in original.items()}
    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")  # CPU tensors by shm name: any local process can map them
    ipc = ServerProc(tiny_model_dir, tmp_path, "ipc", "--weight-ipc")
    try:
        with pytest.raises(WeightSyncError, match="403"):
            push_weights_ipc(plain.url, changed, 7)
        push_weights_ipc(ipc.url, changed, 7)
        for name in ("model.norm.weight", "model.layers.0.mlp.down_proj.weight"):
            got = http("POST", ipc.url + "/get_weights_by_name", {"name": name, "truncate_size": 5})[1]
            assert got == pytest.approx(changed[name].flatten()[:5].tolist(), abs=1e-6), name
        assert http("GET", ipc.url + "/get_model_info")[1]["weight_version"] == "7"
        # as SGLang >= 0.5.21: an update outside a session is refused before it reads the body
        status, body = http(
            "POST", ipc.url + "/update_weights_from_tensor", {"serialized_named_tensors": "x"}
        )
        assert status == 400 and "must run between begin_weight_update()" in body["message"]
        assert http("POST", ipc.url + "/begin_weight_update", {})[0] == 200
        assert http("POST", ipc.url + "/begin_weight_update", {})[1]["message"].startswith(
            "a weight-update session is already open"
        )
        status, body = http(
            "POST", ipc.url + "/update_weights_from_tensor", {"serialized_named_tensors": "x"}
        )
        assert status == 400 and "serialized_named_tensors" in body["message"]
        status, body = http(
            "POST", ipc.url + "/update_weights_from_tensor", {"serialized_named_tensors": ["!!"]}
        )
        assert status == 400 and "update_weights_from_tensor failed" in body["message"]
        assert http("POST", ipc.url + "/end_weight_update", {})[0] == 200
        assert http("POST", ipc.url + "/end_weight_update", {})[0] == 400
    finally:
        mp.set_sharing_strategy(before)
        ipc.kill()


def test_a_server_that_never_answers_is_named_with_the_timeout():
    """A server that takes the request and says nothing (stopped, a black-holed link): the error
    names it and the timeout it ran past (TimeoutError's own message is empty)."""
    import socket

    silent = socket.create_server(("127.0.0.1", 0))  # the kernel accepts; nobody ever answers
    url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    client = RolloutClient(servers=[url], max_retries=0, timeout_s=0.5)

    async def go():
        try:
            await client([1], SamplingParams(max_new_tokens=1))
        finally:
            await client.close()

    with silent, pytest.raises(RolloutError, match=f"{url}: TimeoutError: no answer within 0.5 s"):
        asyncio.run(go())
