import pytest

from agent_r1.agent.flow import AGENTS
from agent_r1.data.rows import DataRow, RowError, load_rows, validate_row, write_rows


def _raw(**kw):
    raw = {
        "data_source": "x",
        "agent_name": "tool_agent",
        "prompt": [{"role": "user", "content": "hi"}],
        "reward_model": {"style": "math_number", "ground_truth": "1"},
        "env_kwargs": '{"tools": ["calculator"]}',
    }
    raw.update(kw)
    return raw


def test_valid_row():
    r = validate_row(_raw())
    assert r.env_kwargs == {"tools": ["calculator"]} and r.extra_info == {}


@pytest.mark.parametrize(
    "patch,msg",
    [
        ({"prompt": None}, r"missing key\(s\) \['prompt'\]"),
        ({"prompt": []}, "key 'prompt' must be a non-empty list"),
        ({"prompt": [{"role": "robot", "content": "x"}]}, r"key 'prompt\[0\]'"),
        ({"prompt": [{"role": "user", "content": 3}]}, r"key 'prompt\[0\]'"),
        ({"agent_name": ""}, "key 'agent_name'"),
        ({"reward_model": {"ground_truth": "1"}}, "key 'reward_model'"),
        ({"env_kwargs": "{not json"}, "key 'env_kwargs' is not valid JSON"),
        ({"env_kwargs": "[1, 2]"}, "key 'env_kwargs' must be a JSON object"),
        ({"extra_info": "nope"}, "key 'extra_info' is not valid JSON"),
    ],
)
def test_invalid_rows_name_the_key(patch, msg):
    with pytest.raises(RowError, match=msg):
        validate_row(_raw(**patch), "row 7")


def test_parquet_roundtrip_and_errors_name_file_and_row(tmp_path):
    rows = [
        validate_row(_raw()),
        DataRow(
            [{"role": "user", "content": "q"}],
            "single_step",
            {"style": "math_number", "ground_truth": 3},
            "y",
        ),
    ]
    path = write_rows(rows, tmp_path / "rows.parquet")
    back = load_rows(path, AGENTS)
    assert back[0] == rows[0] and back[1].reward_model == {"style": "math_number", "ground_truth": "3"}

    bad = [
        rows[0],
        DataRow([{"role": "user", "content": "q"}], "no_such_agent", {"style": "s", "ground_truth": 1}, "y"),
    ]
    path = write_rows(bad, tmp_path / "bad.parquet")
    with pytest.raises(RowError, match=r"bad.parquet row 1: key 'agent_name': unknown agent 'no_such_agent'"):
        load_rows(path, AGENTS)
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(RowError, match="junk.parquet: cannot read parquet"):
        load_rows(tmp_path / "junk.parquet")


def test_context_mode_selectable_from_config(codec):
    """`recipe.env` reaches every row's environment: a ToolEnv recipe summarises for real."""
    import asyncio

    from scripted import ScriptedPolicy

    from agent_r1.agent.flow import AGENTS, FlowConfig
    from agent_r1.agent.tool_calls import format_tool_call
    from agent_r1.agent.types import SamplingParams
    from agent_r1.train.config import load_config
    from agent_r1.train.splits import split_rows

    cfg = load_config(
        ["recipe=gsm8k_tool", "+recipe.env.context=summarize", "+recipe.env.context_kwargs.max_tokens=400"]
    )
    row = split_rows(cfg, "train", 1)[0]
    assert row.env_kwargs == {"context": "summarize", "context_kwargs": {"max_tokens": 400}}
    call = format_tool_call("calculator", {"expression": "1 + 2"})
    policy = ScriptedPolicy(codec, [call] * 4 + ["\\boxed{3}"])
    flow = FlowConfig(
        max_steps=5, max_obs_tokens=4096, max_action_tokens=200, sampling=SamplingParams(max_new_tokens=200)
    )
    traj = asyncio.run(AGENTS.get(row.agent_name).build(policy, codec, flow).run(row, "t", "g"))
    texts = [codec.decode(s.obs_token_ids) for s in traj.steps]
    assert "Summary of earlier steps" not in texts[0] and any(
        "Summary of earlier steps" in t for t in texts[1:]
    )
    # once folded, an observation no longer extends the previous one: the flow records that
    folded = next(i for i, t in enumerate(texts) if "Summary of earlier steps" in t)
    prev = traj.steps[folded - 1]
    assert traj.steps[folded].prefix_len < len(prev.obs_token_ids) + len(prev.action_token_ids)


def test_rows_with_images_round_trip_in_verls_layout(tmp_path):
    """Image parts are stored as verl stores them: ``<image>`` in the content, bytes in ``images``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from agent_r1.vision.images import load_image
    from recipes import load_recipe

    rows = load_recipe("visual_arithmetic").build_rows("test", 3, seed=0)
    path = write_rows(rows, tmp_path / "rows.parquet")
    raw = pq.read_table(path).to_pylist()
    assert raw[0]["prompt"][1]["content"].endswith("<image>") and len(raw[0]["images"]) == 1
    back = load_rows(path)
    for a, b in zip(rows, back, strict=True):
        (qa, ia), (qb, ib) = a.prompt[1]["content"], b.prompt[1]["content"]
        assert qa == qb and load_image(ia["image"]).data == load_image(ib["image"]).data
    raw[0]["images"] = raw[0]["images"] * 2
    pq.write_table(pa.Table.from_pylist(raw), tmp_path / "bad.parquet")
    with pytest.raises(RowError, match="1 <image> placeholder\\(s\\) in 'prompt' but 2 in 'images'"):
        load_rows(tmp_path / "bad.parquet")
