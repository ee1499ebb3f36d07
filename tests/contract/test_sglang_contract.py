"""The project against upstream SGLang's own code, for the oldest and the newest supported release
(``tools/contract/build_env.sh`` installs each release's Python package once, cached under
``.cache/sglang-contract``; GPU-only modules are stand-ins). Every body the weight push and the
rollout client send validates against upstream's request type with no unknown field; the launch
commands the presets render parse with upstream's parser; the trainer's update group meets
upstream's ``init_custom_process_group`` over gloo and a bucket arrives bit-exact through upstream's
``FlattenedTensorBucket``."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from agent_r1.engines.sglang import sglang_command
from agent_r1.process import free_port
from agent_r1.rollout.client import RolloutClient
from agent_r1.rollout.protocol import SamplingParams
from agent_r1.train.config import load_config
from agent_r1.weights.buckets import buckets, flatten
from agent_r1.weights.sglang import (
    BEGIN_BODY,
    CONTINUE_BODY,
    END_BODY,
    PAUSE_BODY,
    ServerProtocol,
    WeightUpdateGroup,
    bucket_body,
)
from agent_r1.weights.update_group import join_update_group, leave_update_group

ROOT = Path(__file__).resolve().parents[2]
RELEASES = ["0.5.6", "0.5.23"]  # the ends of weight_sync's window


@pytest.fixture(scope="session")
def contract_env() -> Path:
    out = subprocess.run(
        ["bash", str(ROOT / "tools/contract/build_env.sh"), sys.executable],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return ROOT / out.stdout.strip().splitlines()[-1]


def upstream(env: Path, release: str, what: str, arg, tmp_path: Path, timeout: float = 120) -> dict:
    f = tmp_path / f"{what}-{release}.json"
    f.write_text(json.dumps(arg))
    path = os.pathsep.join([str(ROOT / "tools/contract"), str(env / f"sglang-{release}"), str(env / "deps")])
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools/contract/sglang_checks.py"), what, str(f)],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": path},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    answer = json.loads(out.stdout.strip().splitlines()[-1])
    assert answer["sglang"] == release
    return answer


def weights() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [  # byte offsets 0, 42, 72, 92, then 98: not a multiple of 4, so the last starts a bucket
        ("model.embed_tokens.weight", torch.randn(7, 3, generator=g).to(torch.bfloat16)),
        ("lm_head.weight", torch.randn(3, 5, generator=g).to(torch.float16)),
        ("model.norm.weight", torch.randn(5, generator=g)),
        ("model.layers.0.input_layernorm.weight", torch.randn(3, generator=g).to(torch.bfloat16)),
        ("model.layers.0.post_attention_layernorm.weight", torch.randn(2, generator=g)),
    ]


def sent_bodies() -> dict[str, list[dict]]:
    """The bodies the project's own code builds, by the upstream type that receives them."""
    g = WeightUpdateGroup(["http://a:1", "http://b:2"], master_address="10.0.0.1")
    g.backend = "nccl"  # as on GPU nodes (the body is what is checked)
    g.protocols = {u: ServerProtocol(u, "0.5.23", tp) for u, tp in (("http://a:1", 2), ("http://b:2", 1))}
    g.group_name = "weight_update_group_0123"
    init = g.init_bodies(29500)
    asyncio.run(g.client.close())
    parts = list(buckets(weights(), 1 << 20))
    updates = [
        bucket_body(b, g.group_name, "7" if i == len(parts) - 1 else None) for i, b in enumerate(parts)
    ]

    captured = []

    class Capture(RolloutClient):  # what the client POSTs, answered as SGLang would
        async def post(self, url, path, body=None):
            assert path == "/generate"
            captured.append(body)
            return {"output_ids": [1], "meta_info": {"output_token_logprobs": [[-0.1, 1, None]],
                                                    "finish_reason": {"type": "length"}}}  # fmt: skip

    async def generate():
        c = Capture(servers=["http://a:1"])
        await c(
            [1, 2, 3],
            SamplingParams(
                temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=16, stop_token_ids=[2], seed=5
            ),
        )
        await c.close()

    asyncio.run(generate())
    return {
        "InitWeightsUpdateGroupReqInput": init,
        "UpdateWeightsFromDistributedReqInput": updates,
        "PauseGenerationReqInput": [PAUSE_BODY],
        "BeginWeightUpdateReqInput": [BEGIN_BODY],
        "EndWeightUpdateReqInput": [END_BODY],
        "ContinueGenerationReqInput": [CONTINUE_BODY],
        "GenerateReqInput": captured,
    }


@pytest.mark.parametrize("release", RELEASES)
def test_every_body_sent_validates_against_upstreams_request_types(contract_env, release, tmp_path):
    sent = sent_bodies()
    wrong = {"InitWeightsUpdateGroupReqInput": [{**sent["InitWeightsUpdateGroupReqInput"][0], "master_port": "x"}],
             "PauseGenerationReqInput": [{"mode": "retract", "flush": True}]}  # fmt: skip
    answer = upstream(contract_env, release, "bodies", sent, tmp_path)
    sessions = ServerProtocol("-", release).sessions
    assert set(answer) == {*sent, "sglang"}
    for name, results in answer.items():
        if name == "sglang":
            continue
        if not sessions and name in ("BeginWeightUpdateReqInput", "EndWeightUpdateReqInput"):
            assert results == ["absent"] * len(results), (name, results)  # pushes skip them (< 0.5.21)
        else:
            assert results == ["ok"] * len(results), (name, results)
    # the check can fail: a wrong type and an unknown field are named
    bad = upstream(contract_env, release, "bodies", wrong, tmp_path)
    assert "master_port" in bad["InitWeightsUpdateGroupReqInput"][0].split(":")[1]
    assert "unknown field(s) ['flush']" in bad["PauseGenerationReqInput"][0]


@pytest.mark.parametrize("release", RELEASES)
def test_every_4n8g_launch_command_parses_with_upstreams_parser(contract_env, release, tmp_path):
    presets = sorted(p.stem for p in (ROOT / "configs/experiment").glob("*_4n8g.yaml"))
    assert presets
    cfgs = [load_config([f"+experiment={preset}"]) for preset in presets]
    cmds = [
        sglang_command(
            "/models/m", "10.0.0.5", 31000, c.model.max_len, c.model.dtype, c.rollout.sglang, "-k3y"
        )
        for c in cfgs
    ]
    bad = ["--model-path", "/m", "--tp-size", "x"]
    answers = upstream(contract_env, release, "argv", [c[3:] for c in cmds] + [bad], tmp_path)["commands"]
    for preset, cfg, cmd, parsed in zip(presets, cfgs, cmds, answers, strict=False):
        assert "error" not in parsed, (preset, cmd)
        p = parsed["parsed"]
        assert p["--tp-size"] == cfg.rollout.sglang.tp and p["--api-key"] == "-k3y", (
            preset
        )  # a key may start with "-"
        assert p["--context-length"] == cfg.model.max_len and p["--port"] == 31000, preset
        assert p["--model-path"] == "/models/m" and p["--dtype"] == cfg.model.dtype, preset
    assert "error" in answers[-1]  # the parser does refuse


@pytest.mark.parametrize("release", RELEASES)
def test_the_trainer_meets_upstreams_process_group_and_a_bucket_arrives_bit_exact(
    contract_env, release, tmp_path
):
    parts = list(buckets(weights(), 1 << 20))
    assert [len(b) for b in parts] == [4, 1]  # the last fp32 tensor would sit unaligned
    bucket = parts[0]  # bf16, fp16, fp32, bf16 at their byte offsets
    port = free_port()
    spec = {"master_address": "127.0.0.1", "master_port": port, "world_size": 2, "rank_offset": 1,
            "group_name": f"weight_update_group_{release.replace('.', '')}",
            **{k: v for k, v in bucket_body(bucket, "-", None).items() if k in ("names", "dtypes", "shapes")}}  # fmt: skip
    answer: dict = {}
    server = threading.Thread(
        target=lambda: answer.update(upstream(contract_env, release, "receive", spec, tmp_path))
    )
    server.start()
    group = join_update_group("gloo", "127.0.0.1", port, 2, 0, spec["group_name"], timeout_s=60)
    try:
        torch.distributed.broadcast(flatten(bucket), src=0, group=group)
    finally:
        leave_update_group(group)
    server.join(120)
    want = {
        n: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest() for n, t in bucket
    }
    assert answer["sha256"] == want
