import asyncio

import numpy as np
import pyarrow as pa
import pytest
from scripted import ScriptedPolicy

from agent_r1.agent.flow import AgentEnvLoop
from agent_r1.agent.tool_calls import format_tool_call
from agent_r1.data.rows import DataRow
from agent_r1.records.schema import (
    STEP_SCHEMA,
    StepRecord,
    check_schema,
    records_from_table,
    records_to_table,
)


def _f32(xs):
    return [float(np.float32(x)) for x in xs]


def _record(**kw):
    base = dict(
        trajectory_id="it3-p0-s1",
        group_id="it3-p0",
        step_index=1,
        obs_token_ids=[1, 2, 3, 4, 5],
        action_token_ids=[7, 8, 9],
        action_logprobs=_f32([-0.1, -2.5, -0.003]),
        action_mask=[1, 0, 1],
        policy_version=12,
        prefix_len=3,
        feedback="<tool_response>\nÉrror ✓ 7\n</tool_response>",
        reward=None,
        process_reward=[0.5, None, -0.1],
        done=True,
        truncated=True,
        finish_reason="length",
        info={"anchor_obs": "room 1", "nested": {"a": [1, 2]}},
    )
    base.update(kw)
    return StepRecord(**base)


def test_roundtrip_table_and_ipc(tmp_path):
    recs = [
        _record(),
        _record(
            step_index=0,
            reward=1.25,
            action_token_ids=[],
            action_logprobs=[],
            action_mask=[],
            process_reward=[],
        ),
    ]
    table = records_to_table(recs)
    assert table.schema.equals(STEP_SCHEMA)
    assert records_from_table(table) == recs
    path = tmp_path / "s.arrow"
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table)
    back = pa.ipc.open_file(pa.memory_map(str(path))).read_all()
    assert records_from_table(back) == recs


def test_roundtrip_of_a_real_episode(codec):
    row = DataRow(
        [{"role": "user", "content": "3+4?"}],
        "tool_agent",
        {"style": "math_number", "ground_truth": "7"},
        "t",
        {"tools": ["calculator"]},
    )
    policy = ScriptedPolicy(codec, [format_tool_call("calculator", {"expression": "3+4"}), "\\boxed{7}"])
    traj = asyncio.run(AgentEnvLoop(policy, codec).run(row, "t", "g"))
    for s in traj.steps:
        s.action_logprobs = _f32(s.action_logprobs)
    assert records_from_table(records_to_table(traj.steps)) == traj.steps


def test_validation():
    with pytest.raises(ValueError, match="differ in length"):
        _record(action_mask=[1])
    with pytest.raises(ValueError, match="prefix_len 9 outside"):
        _record(prefix_len=9)
    with pytest.raises(ValueError, match="not a valid FinishReason"):
        _record(finish_reason="because")


def test_schema_mismatch_is_reported():
    t = records_to_table([_record()]).drop_columns(["prefix_len"])
    with pytest.raises(ValueError, match=r"missing columns \['prefix_len'\]"):
        records_from_table(t)
    t = records_to_table([_record()])
    with pytest.raises(ValueError, match="column 'reward' has type string"):
        check_schema(t.set_column(t.schema.get_field_index("reward"), "reward", pa.array(["x"])).schema)
    with pytest.raises(ValueError, match="unexpected column 'bogus'"):
        check_schema(t.append_column("bogus", pa.array([1])).schema)
    with_adv = t.append_column("advantage", pa.array([0.5]))
    check_schema(with_adv.schema)
    assert records_from_table(with_adv) == [_record()]
