"""`agent-r1 serve` under bad requests: a 400 naming the field for every malformed body (never a
500), a bounded answer when the trainer's address stays silent, weights that are not finite or not
safetensors refused with the old weights kept, long prompt text tokenised off the event loop, and a
schema-driven fuzz of every endpoint that leaves the server healthy."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rollout_servers import ServerProc, http


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("bad_requests")
    (run_dir / "control" / "servers").mkdir(parents=True)
    s = ServerProc(
        tiny_model_dir, run_dir, "b0", "--sglang-version", "0.5.6", "--join-timeout-s", "1",
        "--max-batch-seqs", "64", "--max-prompt-tokens", "600", "--max-header-bytes", "4096",
    )  # fmt: skip
    yield s
    s.kill()


def _raw(
    url: str, data: bytes, content_type: str = "application/json", timeout: float = 30
) -> tuple[int, str]:
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _greedy(url: str) -> list[int]:
    status, out = http("POST", f"{url}/generate", {"input_ids": [5, 6, 7], "sampling_params":
                       {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}})  # fmt: skip
    assert status == 200, out
    return out["output_ids"]


@pytest.mark.parametrize(
    "path, body, says",
    [
        ("/get_weights_by_name", {"name": ["model.norm.weight"]}, "name: must be a non-empty string, got list"),
        ("/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": "ten"}, "truncate_size: must be an integer >= 0"),
        ("/get_weights_by_name", ["model.norm.weight"], "request body must be a JSON object, got list"),
        ("/get_weights_by_name", b"name=model.norm.weight", "request body is not JSON"),
        ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": "abc", "rank_offset": 1,
                                        "world_size": 2}, "master_port: must be a port number in 1..65535, got str 'abc'"),
        ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 0,
                                        "world_size": 2}, "rank_offset: must be in 1..world_size-1"),
        ("/destroy_weights_update_group", [], "request body must be a JSON object, got list"),
        ("/update_weight_version", b"{new_version: 3", "request body is not JSON"),
        ("/update_weight_version", {"new_version": {"v": 1}}, "new_version: must be a string or a number"),
        ("/update_weights_from_disk", {"model_path": 7}, "model_path: must be a non-empty string, got int"),
        ("/update_weights_from_distributed", {"names": "w", "dtypes": ["float32"], "shapes": [[2]]},
         "names: must be a list of strings"),
        ("/generate", {"input_ids": [5, 6], "sampling_params": {"top_k": "abc"}}, "sampling_params.top_k: must be an integer"),
        ("/abort_request", {"rid": 5}, "rid: must be a string"),
    ],
)  # fmt: skip
def test_a_malformed_body_is_a_400_naming_the_field(server, path, body, says):
    if isinstance(body, bytes):
        status, text = _raw(server.url + path, body)
    else:
        status, out = http("POST", server.url + path, body)
        text = json.dumps(out)
    assert status == 400 and says in text, (status, text)
    assert "Traceback" not in text and "Server got itself in trouble" not in text
    assert http("GET", f"{server.url}/health")[0] == 200


def test_weights_that_are_not_finite_or_not_safetensors_are_refused(server, tiny_model_dir, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    before = _greedy(server.url)
    nan = tmp_path / "nan"
    nan.mkdir()
    tensors = load_file(str(next(Path(tiny_model_dir).glob("*.safetensors"))))
    name = next(n for n, t in tensors.items() if t.is_floating_point() and "norm" in n)
    tensors[name] = torch.full_like(tensors[name], float("nan"))
    save_file(tensors, str(nan / "model.safetensors"))
    status, out = http("POST", f"{server.url}/update_weights_from_disk", {"model_path": str(nan)})
    assert (
        status == 400
        and f"{name}: holds NaN or infinite values; the serving weights are kept" in out["message"]
    )
    torn = tmp_path / "torn"
    torn.mkdir()
    data = (nan / "model.safetensors").read_bytes()
    (torn / "model.safetensors").write_bytes(data[: len(data) // 2])
    status, out = http("POST", f"{server.url}/update_weights_from_disk", {"model_path": str(torn)})
    assert status == 400 and "is not a readable safetensors file" in out["message"]
    (torn / "model.safetensors").write_bytes(b"\xff" * 64)
    status, out = http("POST", f"{server.url}/update_weights_from_disk", {"model_path": str(torn)})
    assert status == 400 and "is not a readable safetensors file" in out["message"]
    assert _greedy(server.url) == before  # the old weights kept serving
    # and a good folder still loads
    status, out = http("POST", f"{server.url}/update_weights_from_disk", {"model_path": str(tiny_model_dir)})
    assert status == 200 and out["success"], out


def test_a_silent_master_address_is_answered_in_bounded_time(server, tiny_model_dir):
    """An address that accepts the connection and never speaks: each join answers failure after the
    server's --join-timeout-s (1 s here), and eight of them leave the weight endpoints working."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    conns: list[socket.socket] = []
    threading.Thread(
        target=lambda: [conns.append(silent.accept()[0]) for _ in range(64)], daemon=True
    ).start()
    port = silent.getsockname()[1]
    body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}
    for i in range(8):
        t0 = time.time()
        status, out = http("POST", f"{server.url}/init_weights_update_group", {**body, "group_name": f"g{i}"})
        assert status == 400 and time.time() - t0 < 15, (status, out)
        assert "no rendezvous" in out["message"] or "earlier joins never finished" in out["message"], out
    status, out = http("POST", f"{server.url}/update_weights_from_disk", {"model_path": str(tiny_model_dir)},
                       timeout=60)  # fmt: skip
    assert status == 200 and out["success"], out
    silent.close()


@pytest.mark.parametrize(
    "path, body",
    [
        ("/generate", lambda text: {"text": text, "sampling_params": {"max_new_tokens": 1}}),
        ("/v1/completions", lambda text: {"model": "m", "prompt": text, "max_tokens": 1}),
        ("/v1/chat/completions",
         lambda text: {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": text}]}),
    ],
)  # fmt: skip
def test_long_prompt_text_is_tokenised_off_the_event_loop(server, path, body):
    """5 MB of prompt text (tens of seconds of tokenising) on each route that takes text: /health
    answers throughout (the OpenAI routes tokenised on the event loop: ~20 s of silence for 20 MB)."""
    text = "word " * 1_000_000
    slowest = []

    def health() -> None:
        for _ in range(10):
            t0 = time.time()
            assert http("GET", f"{server.url}/health", timeout=30)[0] == 200
            slowest.append(time.time() - t0)
            time.sleep(0.05)

    with ThreadPoolExecutor(2) as ex:
        t0 = time.time()
        big = ex.submit(http, "POST", server.url + path, body(text), 120)
        time.sleep(0.3)  # the tokenisation is under way
        ex.submit(health).result(timeout=120)
        status, out = big.result(timeout=120)
        took = time.time() - t0
    assert status == 400 and "context length 1024" in json.dumps(out), str(out)[:300]
    # a loop blocked by the tokenisation answers /health only once it is done: the slowest answer
    # would take most of the big request's time; relative, so a busy machine slows both alike
    assert max(slowest) < max(0.25 * took, 1.0), (slowest, took)


def test_weight_paths_the_server_cannot_use_are_400s_never_a_hang(server, tmp_path):
    """A FIFO named like a checkpoint (a hung network filesystem behaves the same: its open never
    returns, and the loader's open holds the GIL, so the whole server froze), a path too long for
    the filesystem (a 500 before), a file where a folder belongs: each a 400 naming the path, the
    old weights kept, /health answering throughout."""
    import os

    before = _greedy(server.url)
    fifo_dir = tmp_path / "fifo"
    fifo_dir.mkdir()
    os.mkfifo(fifo_dir / "model.safetensors")
    plain = tmp_path / "file.safetensors"
    plain.write_bytes(b"x")
    for path, says in [
        (str(fifo_dir), "is not a regular file"),
        ("/" + "a" * 5000, "File name too long"),
        (str(plain), "is not a folder"),
        (str(tmp_path / "missing"), "No such file or directory"),
    ]:
        status, out = http("POST", f"{server.url}/update_weights_from_disk", {"model_path": path}, timeout=30)
        assert status == 400 and says in out["message"], (path[:80], status, out)
        assert http("GET", server.url + "/health", timeout=5)[0] == 200
    assert _greedy(server.url) == before


def test_a_prompt_over_the_token_limit_is_a_413_naming_the_flag(server):
    sp = {"max_new_tokens": 1}
    status, out = http("POST", server.url + "/generate", {"input_ids": [5] * 601, "sampling_params": sp})
    assert (
        status == 413
        and "--max-prompt-tokens" in out["error"]["message"]
        and "600" in out["error"]["message"]
    )
    assert http("POST", server.url + "/generate", {"input_ids": [5] * 600, "sampling_params": sp})[0] == 200


def test_a_header_over_the_limit_is_a_400_and_the_server_serves_on(server):
    def get(header: str) -> int:
        req = urllib.request.Request(server.url + "/v1/loads", headers={"X-Pad": header})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    assert get("x" * 5000) == 400  # --max-header-bytes 4096
    assert get("x" * 3000) == 200 and http("GET", server.url + "/health")[0] == 200


def _from(source: str, method: str, url: str, body: object | None = None) -> tuple[int, object]:
    """An HTTP call from the loopback address ``source`` (another client than 127.0.0.1)."""
    import http.client
    import urllib.parse

    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120, source_address=(source, 0))
    try:
        conn.request(method, u.path, json.dumps(body) if body is not None else None,
                     {"Content-Type": "application/json"})  # fmt: skip
        r = conn.getresponse()
        raw = r.read().decode()
        return r.status, json.loads(raw) if raw else None
    finally:
        conn.close()


def test_one_client_holds_at_most_its_share_of_requests(tiny_model_dir, tmp_path):
    """--max-client-requests: with generation paused, two requests of client 127.0.0.2 hang in
    flight; its third is a 429 naming the flag at once, while another client (127.0.0.1) is served;
    once the two end, 127.0.0.2 is served again."""
    (tmp_path / "control" / "servers").mkdir(parents=True)
    s = ServerProc(tiny_model_dir, tmp_path, "c0", "--max-client-requests", "2")
    try:
        assert http("POST", s.url + "/pause_generation", {"mode": "in_place"})[0] == 200
        body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}
        with ThreadPoolExecutor(2) as ex:
            held = [ex.submit(_from, "127.0.0.2", "POST", s.url + "/generate", body) for _ in range(2)]
            deadline = time.time() + 60  # a guard against a hang: the two arrive in milliseconds
            while (answer := _from("127.0.0.2", "GET", s.url + "/v1/loads"))[0] != 429:
                assert answer[0] == 200 and time.time() < deadline, answer
            message = answer[1]["error"]["message"]
            assert "--max-client-requests" in message and "127.0.0.2" in message
            assert http("GET", s.url + "/v1/loads")[0] == 200  # another client is served meanwhile
            assert http("POST", s.url + "/continue_generation", {})[0] == 200
            assert [f.result(timeout=120)[0] for f in held] == [200, 200]
        assert _from("127.0.0.2", "POST", s.url + "/generate", body)[0] == 200
    finally:
        s.kill()


def test_a_batch_over_the_sequence_limit_is_a_413_naming_the_flag(server):
    """Sequences per /generate (prompts x n) are bounded by --max-batch-seqs, not only by the body
    size (a 25,600-sequence batch fit in the default body limit)."""
    sp = {"max_new_tokens": 1, "n": 8}
    status, out = http("POST", server.url + "/generate", {"input_ids": [[5, 6]] * 9, "sampling_params": sp})
    assert status == 413 and "--max-batch-seqs" in out["error"]["message"] and "64" in out["error"]["message"]
    status, out = http("POST", server.url + "/generate", {"input_ids": [[5, 6]] * 8, "sampling_params": sp})
    assert status == 200 and len(out) == 64


@pytest.mark.parametrize("raw", [False, True], ids=["escaped", "raw"])
@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/generate", {"text": "2 + 2 = ?", "sampling_params": {"max_new_tokens": 1}}, "text"),
        ("/v1/completions", {"model": "m", "prompt": "2 + 2 = ?", "max_tokens": 1}, "prompt"),
        ("/v1/chat/completions", {"model": "m", "max_tokens": 1,
                                  "messages": [{"role": "user", "content": "2 + 2 = ?"}]}, "messages[0].content"),
    ],
)  # fmt: skip
def test_text_with_a_lone_surrogate_is_a_400_naming_the_field(server, path, body, field, raw):
    """A lone UTF-16 surrogate in a prompt, escaped (``\\ud800``) or as raw bytes, is not text a
    tokenizer can take: 400 naming the field (it was a 500 on the OpenAI routes and a 400 that named
    nothing on /generate); the server keeps serving."""
    data = json.dumps(body).replace("2 + 2", "2 \\ud800 2").encode()
    if raw:  # the surrogate's UTF-8 form, which Python's JSON parser also lets through
        data = data.replace(b"\\ud800", b"\xed\xa0\x80")
    status, text = _raw(server.url + path, data)
    assert status == 400 and field in text and "lone surrogate U+D800" in text, (status, text[:300])
    assert http("GET", server.url + "/health")[0] == 200


# ---- fuzz: bodies shaped like each endpoint's, with wrong types and values ------------------------
ENDPOINTS = {
    "/generate": ["text", "input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len",
                  "top_logprobs_num", "stream", "image_data"],
    "/get_weights_by_name": ["name", "truncate_size"],
    "/init_weights_update_group": ["master_address", "master_port", "rank_offset", "world_size", "group_name",
                                   "backend"],
    "/destroy_weights_update_group": ["group_name"],
    "/update_weights_from_disk": ["model_path", "weight_version", "abort_all_requests"],
    "/update_weights_from_distributed": ["names", "dtypes", "shapes", "group_name", "load_format", "flush_cache"],
    "/update_weight_version": ["new_version", "abort_all_requests"],
    "/abort_request": ["rid", "abort_all"],
    "/pause_generation": ["mode"],
    "/flush_cache": [],
}  # fmt: skip
_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.sampled_from(["", "0", "float32", "gloo", "127.0.0.1", "model.norm.weight", "retract"]),
)  # fmt: skip
_value = st.recursive(
    _leaf,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


@st.composite
def _request(draw):
    path = draw(st.sampled_from(sorted(ENDPOINTS)))
    keys = draw(st.lists(st.sampled_from(ENDPOINTS[path] or ["x"]), unique=True, max_size=4))
    body = {k: draw(_value) for k in keys}
    if path == "/generate" and "input_ids" not in body and "text" not in body:
        body["input_ids"] = draw(st.lists(st.integers(-5, 5000), max_size=4))
    if path == "/generate":
        sp = body.get("sampling_params")
        if not isinstance(sp, dict):
            body["sampling_params"] = {"max_new_tokens": 2}
        else:
            sp["max_new_tokens"] = 2  # bounded work per request
    if path == "/init_weights_update_group":
        body["master_address"] = "127.0.0.1"  # never a real host (the port is fuzzed: nobody listens)
    if path == "/update_weights_from_disk":
        body["model_path"] = draw(st.sampled_from(["/nonexistent", "", 7, None]))
    raw = json.dumps(body, allow_nan=True).encode()
    return path, draw(st.sampled_from([raw, raw, raw, b"[1, 2]", raw[: len(raw) // 2], b"\xff\xfe"]))


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(req=_request())
def test_fuzzed_bodies_get_4xx_or_2xx_and_the_server_stays_healthy(server, req):
    path, data = req
    status, text = _raw(server.url + path, data, timeout=60)
    assert status < 500, (path, data[:200], status, text[:500])
    assert http("GET", f"{server.url}/health", timeout=10)[0] == 200
    if path == "/pause_generation":
        assert http("POST", f"{server.url}/continue_generation", {})[0] == 200
