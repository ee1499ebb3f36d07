"""`agent-r1 index build` + `agent-r1 retriever serve` as real processes; the HTTP client, the
search tool, and bad input on both sides."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from agent_r1.agent_tools import TOOLS, ToolError
from agent_r1.agent_tools.services import Services
from agent_r1.retrieval.client import HttpRetriever, LocalRetriever, RetrievalError, open_index

CLI = [sys.executable, "-m", "agent_r1.cli"]
KEY = "s3cret"


@pytest.fixture(scope="module")
def world_index(tmp_path_factory):
    out = tmp_path_factory.mktemp("idx") / "world"
    r = subprocess.run(
        [*CLI, "index", "build", "--recipe", "hotpotqa", "--out", str(out)], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["passages"] > 300
    return out


@pytest.fixture(scope="module")
def server(world_index, tmp_path_factory):
    ready = tmp_path_factory.mktemp("srv") / "ready.json"
    cmd = [
        *CLI,
        "retriever",
        "serve",
        "--index",
        str(world_index),
        "--port",
        "0",
        "--ready-file",
        str(ready),
        "--api-key",
        KEY,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not ready.exists():
        assert proc.poll() is None, proc.stderr.read()
        assert time.time() < deadline, "retriever did not start"
        time.sleep(0.1)
    yield json.loads(ready.read_text())["url"]
    proc.terminate()
    assert proc.wait(20) == 0


def _post(url: str, body, key: str | None = KEY) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(f"{url}/retrieve", data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_search_r1_api_shape_and_same_hits_as_in_process(server, world_index):
    from recipes.hotpotqa import world as W

    title = next(iter(W.make_world(0).works))
    status, body = _post(server, {"queries": [title, "born in"], "topk": 3, "return_scores": True})
    assert status == 200 and len(body["result"]) == 2 and len(body["result"][0]) == 3
    first = body["result"][0][0]
    assert first["document"]["id"] == f"work:{title}" and first["document"]["contents"].startswith(
        f'"{title}"\n'
    )
    assert isinstance(first["score"], float)
    local = open_index(str(world_index)).search([title, "born in"], 3)
    assert [[h["document"]["id"] for h in row] for row in body["result"]] == [
        [h.id for h in row] for row in local
    ]
    status, body = _post(server, {"queries": [title], "topk": 1})  # without scores: the documents
    assert status == 200 and body["result"][0][0]["id"] == f"work:{title}"


def test_concurrent_clients_get_their_own_results(server):
    from recipes.hotpotqa import world as W

    titles = list(W.make_world(0).works)[:24]
    client = HttpRetriever(server, KEY)

    async def go():
        return await asyncio.gather(*(client.search([t], 2) for t in titles))

    results = asyncio.run(go())
    assert [r[0][0].id for r in results] == [f"work:{t}" for t in titles]


@pytest.mark.parametrize(
    "body,needle",
    [
        ({"queries": []}, "non-empty list"),
        ({"queries": "x"}, "non-empty list"),
        ({"queries": ["ok", 3]}, "queries[1] must be a string"),
        ({"queries": ["x" * 5000]}, "characters (max 2000)"),
        ({"queries": ["x"], "topk": 0}, "'topk' must be an integer"),
        (b"{nope", "not JSON"),
    ],
)
def test_bad_requests_get_400_naming_the_field(server, body, needle):
    status, out = _post(server, body)
    assert status == 400 and needle in out["error"]["message"]


def test_api_key_is_required(server):
    status, out = _post(server, {"queries": ["x"]}, key=None)
    assert status == 401
    with urllib.request.urlopen(f"{server}/health", timeout=10) as r:  # liveness stays open
        assert json.loads(r.read())["status"] == "ok"


def test_dead_server_is_retried_then_reported():
    dead = HttpRetriever("http://127.0.0.1:9", retries=2, timeout_s=2)
    t0 = time.time()
    with pytest.raises(RetrievalError, match="127.0.0.1:9 failed"):
        asyncio.run(dead.search(["x"], 1))
    assert time.time() - t0 >= 1.0  # two back-offs: 0.5 + 1.0 s


def test_search_tool_errors_are_tool_errors(world_index):
    tool = TOOLS.get("search")(topk=2)
    tool.services = Services(retriever=LocalRetriever(open_index(str(world_index))))  # as its ToolEnv does
    out = asyncio.run(tool.execute({"query": "Where was it?"}))
    assert out.result.startswith("Doc 1(Title: ") and len(out.info["hits"]) == 2
    for args, needle in [({"query": "   "}, "empty"), ({"query": "q" * 400}, "max 300")]:
        with pytest.raises(ToolError, match=needle):
            asyncio.run(tool.execute(args))
    with pytest.raises(ToolError, match="invalid argument 'query'"):
        tool.validate({"query": 5})
    with pytest.raises(ToolError, match="'query' is a required property"):
        tool.validate({})
    down = TOOLS.get("search")(url="http://127.0.0.1:9")  # retried (0.5 + 1 + 2 s), then reported
    with pytest.raises(ToolError, match="retrieval failed .*127.0.0.1:9 failed"):
        asyncio.run(down.execute({"query": "x"}))


def test_no_retriever_configured_is_a_clear_error():
    with pytest.raises(ToolError, match="no retriever configured: set retrieval.index"):
        asyncio.run(TOOLS.get("search")().execute({"query": "x"}))


def test_index_build_errors_name_the_file(tmp_path):
    bad = tmp_path / "corpus.jsonl"
    bad.write_text('{"id": "1", "contents": "ok"}\n{"id": "2"}\n')
    for args, needle in [
        (["--corpus", str(bad)], f"agent-r1 index build: {bad}:2: passage needs 'contents' or 'text'"),
        (["--dataset", str(tmp_path / "none.json")], "none.json does not exist"),
    ]:
        r = subprocess.run(
            [*CLI, "index", "build", *args, "--out", str(tmp_path / "idx")], capture_output=True, text=True
        )
        assert r.returncode == 1 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "idx").exists() and not (tmp_path / "idx.tmp").exists()


def test_the_runs_search_tools_follow_a_restarted_retriever(server, world_index, tmp_path):
    """`run_retriever`: the address is read again for every request, so a retriever the
    launcher restarted on a new port is found (the old client kept retrying the dead address)."""
    from agent_r1.retrieval.client import run_retriever
    from agent_r1.train.config import load_config
    from agent_r1.train.run_dir import RunDir

    cfg = load_config(
        ["+experiment=hotpotqa_steppo", f"retrieval.index={world_index}", "retrieval.serve=true"]
    )
    rd = RunDir.at(tmp_path)
    rd.retriever_file.parent.mkdir(parents=True, exist_ok=True)
    rd.api_key_file.parent.mkdir(parents=True, exist_ok=True)
    rd.api_key_file.write_text(KEY)  # the run's key, which its retriever requires
    rd.retriever_file.write_text(json.dumps({"url": "http://127.0.0.1:9"}))  # the one that died
    r = run_retriever(cfg, rd)
    r.retries, r.timeout_s = 0, 2
    with pytest.raises(RetrievalError, match="127.0.0.1:9 failed"):
        asyncio.run(r.search(["x"], 1))
    rd.retriever_file.write_text(json.dumps({"url": server}))  # restarted, on another port
    hits = asyncio.run(r.search(["university"], 3))[0]
    assert len(hits) == 3


def test_fuzzed_retrieve_bodies_get_4xx_or_2xx(server):
    """Search-R1 bodies of every wrong shape: a 400 or hits, never a 500, the server still answers."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    value = st.recursive(st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats() | st.text(max_size=10),
                         lambda v: st.lists(v, max_size=4) | st.dictionaries(st.text(max_size=5), v, max_size=3),
                         max_leaves=8)  # fmt: skip

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body=st.dictionaries(st.sampled_from(["queries", "topk", "return_scores"]), value, max_size=3)
           | value)  # fmt: skip
    def check(body):
        data = json.dumps(body, allow_nan=True).encode()
        status, out = _post(server, data)
        assert status in (200, 400), (body, status, out)

    check()
    assert _post(server, {"queries": ["who"], "topk": 1})[0] == 200
