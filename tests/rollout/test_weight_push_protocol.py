"""The weight push's protocol with SGLang: rank layout over TP ranks, the supported release window,
dtype-aligned buckets, one update session per push (sessions from 0.5.21, none before). A push in
the middle of generation: ``test_step_atomic.py``."""

from __future__ import annotations

import asyncio

import pytest
import torch
from helpers.rollout_servers import ServerProc, http

from agent_r1.weights.buckets import buckets
from agent_r1.weights.sglang import ServerProtocol, WeightUpdateGroup, check_server_info
from agent_r1.weights.transport import WeightSyncError, release


def test_rank_offsets_count_every_tp_rank_of_every_server():
    # SGLang joins rank_offset + tp_rank: servers of TP 2, 4 and 1 take ranks 1-2, 3-6 and 7
    g = WeightUpdateGroup(["http://a", "http://b", "http://c"])
    g.protocols = {
        "http://a": ServerProtocol("http://a", "0.5.23", 2),
        "http://b": ServerProtocol("http://b", "0.5.23", 4),
        "http://c": ServerProtocol("http://c", "0.5.6", 1),
    }
    bodies = g.init_bodies(1234)
    assert [b["rank_offset"] for b in bodies] == [1, 3, 7]
    assert {b["world_size"] for b in bodies} == {8}
    asyncio.run(g.client.close())


def test_release_window_and_layouts_the_update_group_cannot_number():
    assert release("0.5.6.post2") == (0, 5, 6) and release("0.5.21rc1") == (0, 5, 21)
    assert not check_server_info("u", {"version": "0.5.6", "tp_size": 2}).sessions
    assert check_server_info("u", {"version": "0.5.21"}).sessions
    assert check_server_info("u", {"version": "0.5.23", "tp_size": 4}).tp_size == 4
    for bad in ("0.5.5", "0.4.10", "0.6.0", "", "agent-r1-embedded-0.1"):
        with pytest.raises(WeightSyncError, match="supports 0.5.6 <= version < 0.6"):
            check_server_info("http://s:1", {"version": bad})
    with pytest.raises(WeightSyncError, match="dp_size=2"):
        check_server_info("http://s:1", {"version": "0.5.23", "dp_size": 2})
    with pytest.raises(WeightSyncError, match="pp_size=2"):
        check_server_info("http://s:1", {"version": "0.5.23", "pp_size": 2})


def test_a_tensor_that_would_sit_unaligned_starts_a_new_bucket():
    # bytes: 3 (uint8) | 4 (bf16 x2) | 8 (fp32 x2) | 6 (bf16 x3) | 4 (fp32)
    named = [
        ("a", torch.zeros(3, dtype=torch.uint8)),
        ("b", torch.zeros(2, dtype=torch.bfloat16)),  # offset 3: odd for bf16 -> new bucket
        ("c", torch.zeros(2, dtype=torch.float32)),  # offset 4: aligned
        ("d", torch.zeros(3, dtype=torch.bfloat16)),  # offset 12: aligned
        ("e", torch.zeros(1, dtype=torch.float32)),  # offset 18: not a multiple of 4 -> new bucket
    ]
    assert [[n for n, _ in b] for b in buckets(named, 1 << 20)] == [["a"], ["b", "c", "d"], ["e"]]
    assert [[n for n, _ in b] for b in buckets(named, 8)] == [["a"], ["b"], ["c"], ["d"], ["e"]]


@pytest.fixture(scope="module")
def old_and_new(tiny_model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("protocol")
    servers = [
        ServerProc(tiny_model_dir, run_dir, "old", "--sglang-version", "0.5.6", "--strict"),
        ServerProc(tiny_model_dir, run_dir, "new", "--strict"),
    ]
    yield servers
    for s in servers:
        s.kill()


def changed_weights(tiny_model_dir, scale):
    from safetensors.torch import load_file

    original = load_file(str(tiny_model_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(3)
    return {n: t + scale * torch.randn(t.shape, generator=g) for n, t in original.items()}


def test_one_push_updates_a_pre_session_and_a_session_release(old_and_new, tiny_model_dir):
    old, new = old_and_new
    assert http("POST", old.url + "/begin_weight_update", {})[0] == 404  # 0.5.6 has no sessions
    assert http("POST", new.url + "/update_weights_from_distributed", {})[1]["message"].endswith(
        "must run between begin_weight_update() and end_weight_update()"
    )
    weights = changed_weights(tiny_model_dir, 0.01)

    async def go():
        group = WeightUpdateGroup([old.url, new.url])
        await group.init(timeout_s=60)
        try:
            assert group.group_name.startswith("weight_update_group_")
            await group.push(weights.items(), 3, bucket_bytes=32 * 1024)
            first = group.group_name
        finally:
            await group.close()
        await group.init(timeout_s=60)  # re-formed: a fresh name, the old one was destroyed
        try:
            assert group.group_name != first
            await group.push(weights.items(), 4, bucket_bytes=1 << 30)
        finally:
            await group.close()

    asyncio.run(go())
    name = "model.layers.0.mlp.down_proj.weight"
    for s in (old, new):
        assert http("GET", s.url + "/model_info")[1]["weight_version"] == "4"
        got = http("POST", s.url + "/get_weights_by_name", {"name": name, "truncate_size": 4})[1]
        assert got == pytest.approx(weights[name].flatten()[:4].tolist(), abs=1e-6)
        # the session is closed and generation continues
        assert http("POST", s.url + "/end_weight_update", {})[0] in (400, 404)
        st, out = http(
            "POST", s.url + "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
        )
        assert st == 200 and out["meta_info"]["weight_version"] == "4"
