"""The WebShop environment server (``agent-r1 env serve webshop``): 64 shoppers at once on one
server keep their sessions apart and end exactly where the in-process site ends; bad requests get
400s naming the field; a server that dies under an episode ends it as an environment error, which
the rollout worker drops and counts."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time

import pytest
from scripted import ScriptedPolicy

from agent_r1.agent.flow import AGENTS, FlowConfig
from agent_r1.agent.types import SamplingParams
from recipes import load_recipe

D = load_recipe("webshop").data
from recipes.webshop.catalog import Goal  # noqa: E402
from recipes.webshop.data import shop_for  # noqa: E402
from recipes.webshop.sessions import EnvServerError, LocalSession, RemoteSession  # noqa: E402


class EnvServer:
    def __init__(self, tmp_path, *extra: str):
        self.ready = tmp_path / f"env_{time.time_ns()}.json"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agent_r1.cli", "env", "serve", "webshop", "--ready-file", str(self.ready), *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        deadline = time.time() + 60
        while not self.ready.exists():
            assert self.proc.poll() is None and time.time() < deadline, self.proc.stderr.read()[-2000:]
            time.sleep(0.1)
        self.url = json.loads(self.ready.read_text())["url"]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = EnvServer(tmp_path_factory.mktemp("env"))
    yield s
    s.kill()


def test_64_concurrent_shoppers_keep_their_sessions_apart(server):
    rows = D.build_rows("train", 64, 0)
    shop = shop_for(None, 0, False)
    plans = []
    for i, row in enumerate(rows):
        goal = Goal(**row.extra_info["goal"])
        actions = D.oracle(goal, shop)
        if i % 2:  # every other shopper also wanders: pages back and forth, invalid clicks
            actions = [actions[0], "click[next >]", "click[nope]", "click[< prev]", *actions[1:]]
        plans.append((goal, actions))

    async def shop_remote(goal, actions):
        s = RemoteSession(server.url, goal)
        out = []
        try:
            for a in actions:
                ok, _ = await s.act(a)
                out.append((ok, s.snap))
                await asyncio.sleep(0)  # interleave the sessions
        finally:
            await s.close()
        return out

    async def shop_local(goal, actions):
        s = LocalSession(shop, goal)
        return [((await s.act(a))[0], s.snap) for a in actions]

    async def both():
        remote = await asyncio.gather(*(shop_remote(g, a) for g, a in plans))
        local = [await shop_local(g, a) for g, a in plans]
        return remote, local

    remote, local = asyncio.run(both())
    assert remote == local  # every page, choice and score as the in-process site has them
    assert all(r[-1][1].page == "done" and r[-1][1].reward == 1.0 for r in remote)
    assert sum(1 for r in remote for ok, _ in r if not ok) == 32  # the wanderers' invalid clicks


@pytest.mark.parametrize(
    ("path", "body", "says"),
    [
        ("/reset", {"goal": {"asin": "x"}}, "goal: must be an object with keys"),
        ("/reset", {"goal": {**D.catalog()[1][0].to_json(), "instruction_text": ["buy", "a", "mug"]}},
         "goal.instruction_text: must be a string, got list"),
        ("/reset", {"goal": {**D.catalog()[1][0].to_json(), "attributes": "machine wash"}},
         "goal.attributes: must be a list of strings, got str"),
        ("/reset", {"goal": {**D.catalog()[1][0].to_json(), "price_upper": "cheap"}},
         "goal.price_upper: must be a finite number"),
        ("/reset", {"goal": {**D.catalog()[1][0].to_json(), "goal_options": 3}},
         "goal.goal_options: must be an object of strings or a list of strings"),
        ("/step", {"session": 3, "action": "search[x]"}, "'session' must be a string"),
        ("/step", {"session": "nope", "action": "search[x]"}, "no session 'nope'"),
        ("/step", [], "body must be a JSON object"),
    ],
)  # fmt: skip
def test_bad_requests_name_the_field(server, path, body, says):
    import urllib.error
    import urllib.request

    req = urllib.request.Request(
        server.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code in (400, 404) and says in json.loads(e.value.read())["error"]["message"]


def test_a_dead_server_ends_the_episode_as_an_environment_error(codec, tmp_path):
    srv = EnvServer(tmp_path)
    row = D.build_rows("test", 1, 0)[0]
    row = type(row)(**{**row.__dict__, "env_kwargs": {**row.env_kwargs, "server": srv.url}})
    demo = D.demonstrations([row])[0]

    class KillAfterFirst(ScriptedPolicy):
        async def __call__(self, ids, sampling):
            if len(self.calls) == 1:
                srv.kill()  # the site dies after the first action
            return await super().__call__(ids, sampling)

    flow = FlowConfig(
        max_steps=15, max_action_tokens=400, max_obs_tokens=8192, sampling=SamplingParams(max_new_tokens=400)
    )
    t = asyncio.run(
        AGENTS.get(row.agent_name).build(KillAfterFirst(codec, demo), codec, flow).run(row, "t", "g")
    )
    assert len(t.steps) == 2 and t.steps[0].info.get("env_error") is None
    assert "unreachable" in t.steps[-1].info["env_error"] and t.metrics["env_error"] == 1.0
    # the rollout worker drops it (and counts it): never trained on
    from agent_r1.train.worker import drop_env_errors

    kept, dropped = drop_env_errors("task", [t])
    assert kept == [] and dropped == [t]
    with pytest.raises(EnvServerError, match="unreachable after 3 tries"):
        asyncio.run(RemoteSession(srv.url, Goal(**row.extra_info["goal"])).act("search[x]"))


def test_fuzzed_requests_get_4xx_or_2xx_and_sessions_keep_working(server):
    """Bodies of the wrong shapes (a goal's fields swapped for any JSON), never a 500; afterwards a
    real session still shops to the end."""
    import urllib.error
    import urllib.request

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    def post(path, body):
        req = urllib.request.Request(server.url + path, json.dumps(body, allow_nan=True).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    goal = D.catalog()[1][0].to_json()
    value = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                         lambda v: st.lists(v, max_size=3) | st.dictionaries(st.text(max_size=5), v, max_size=3),
                         max_leaves=6)  # fmt: skip

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(path=st.sampled_from(["/reset", "/step", "/close"]), swap=st.dictionaries(st.sampled_from(sorted(goal)), value, max_size=3),
           session=value, action=value)  # fmt: skip
    def check(path, swap, session, action):
        body = {"goal": {**goal, **swap}} if path == "/reset" else {"session": session, "action": action}
        status, out = post(path, body)
        assert status < 500, (path, body, status, str(out)[:300])
        if status == 200 and path == "/reset":  # an accepted goal: its session answers steps
            assert post("/step", {"session": out["session"], "action": "search[mug]"})[0] == 200

    check()
    status, out = post("/reset", {"goal": goal})
    assert status == 200
    assert post("/step", {"session": out["session"], "action": "search[mug]"})[0] == 200
