"""Every HTTP endpoint the rollout, weight-sync and training code calls is one upstream SGLang 0.5.x
serves (or, for ``/workers``, one ``sglang-router`` serves): read from the code with ``ast``, so a
call to an endpoint only the embedded server has (``/get_weight_version``) fails here. The routes of
the client's SGLang API (``server_api.SGLangAPI``) are asked from the object itself; those of its
vLLM API are checked against vLLM's own routes in ``tests/contract/test_vllm.py``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from agent_r1.engines.embedded.server import UPSTREAM_ENDPOINTS

ROOT = Path(__file__).resolve().parents[2] / "agent_r1"
CALLERS = [
    ROOT / "rollout" / "client.py",
    # the weight push to SGLang's API (vLLM's transport, weights/vllm.py, speaks vLLM's routes)
    *(ROOT / "weights" / f for f in ("sglang.py", "disk.py", "transport.py", "sender.py")),
    *sorted((ROOT / "train").glob("*.py")),
]
ROUTER_ENDPOINTS = {"/workers", "/generate"}
PATH = re.compile(r"^/[a-z_]+(/[a-z_]+)*$")


def _paths_in(node: ast.AST) -> list[str]:
    """Endpoint-like string parts of a call argument: "/x", f"{url}/x", url + "/x"."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and PATH.match(node.value):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [
            v.value.split("?")[0]
            for v in node.values
            if isinstance(v, ast.Constant) and PATH.match(v.value.split("?")[0])
        ]
    if isinstance(node, ast.BinOp):
        return _paths_in(node.left) + _paths_in(node.right)
    return []


def sglang_api_endpoints() -> list[str]:
    from agent_r1.rollout.protocol import SamplingParams
    from agent_r1.rollout.server_api import SGLangAPI

    api = SGLangAPI()
    return [
        api.generate([1], SamplingParams(), None).path,
        api.abort(None).path,
        api.health_path,
        api.version_path,
    ]


def called_endpoints() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {
        p: ["agent_r1/rollout/server_api.py: SGLangAPI"] for p in sglang_api_endpoints()
    }
    for path in CALLERS:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                for arg in [*node.args, *(k.value for k in node.keywords)]:
                    for p in _paths_in(arg):
                        out.setdefault(p, []).append(f"{path.relative_to(ROOT.parent)}:{node.lineno}")
    return out


def test_the_scan_sees_the_calls_it_must_check():
    found = called_endpoints()
    for p in (
        "/generate",
        "/get_model_info",
        "/init_weights_update_group",
        "/update_weights_from_disk",
        "/health",
    ):
        assert p in found, sorted(found)


def test_only_upstream_sglang_endpoints_are_called():
    bad = {
        p: where for p, where in called_endpoints().items() if p not in UPSTREAM_ENDPOINTS | ROUTER_ENDPOINTS
    }
    assert not bad, f"endpoints upstream SGLang does not serve: {bad}"
