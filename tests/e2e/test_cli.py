import subprocess
import sys

import pyarrow as pa

from agent_r1.records.schema import records_from_table


def test_rollout_cli_end_to_end(tiny_model_dir, tmp_path):
    out = tmp_path / "records.arrow"
    data = tmp_path / "rows.parquet"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "agent_r1.cli",
            "data",
            "--recipe",
            "arithmetic_tool",
            "--split",
            "test",
            "--num",
            "3",
            "--out",
            str(data),
        ],
        check=True,
    )
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "agent_r1.cli",
            "rollout",
            "--model",
            str(tiny_model_dir),
            "--data",
            str(data),
            "--episodes",
            "3",
            "--group-size",
            "2",
            "--temperature",
            "1.0",
            "--max-action-tokens",
            "24",
            "--out",
            str(out),
            "--no-progress",
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    lines = [line for line in res.stdout.splitlines() if " episode " in line]
    assert len(lines) == 6 and all(
        "steps=" in line and "tool_calls=" in line and "reward=" in line for line in lines
    )
    assert '"episodes": 6' in res.stdout
    recs = records_from_table(pa.ipc.open_file(pa.memory_map(str(out))).read_all())
    assert {r.group_id for r in recs} == {"it0-p0", "it0-p1", "it0-p2"}
    assert len({r.trajectory_id for r in recs}) == 6
    assert all(
        len(r.action_token_ids) <= 24 and r.action_logprobs and max(r.action_logprobs) <= 0 for r in recs
    )


def test_cli_rejects_unknown_recipe():
    res = subprocess.run(
        [sys.executable, "-m", "agent_r1.cli", "data", "--recipe", "nope", "--out", "x"],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2 and "invalid choice: 'nope'" in res.stderr


def test_cli_data_names_an_unknown_split(tmp_path):
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "agent_r1.cli",
            "data",
            "--recipe",
            "alfworld",
            "--split",
            "bogus",
            "--out",
            str(tmp_path / "x.parquet"),
        ],  # fmt: skip
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert (
        "agent-r1 data: alfworld: unknown split 'bogus'; known: ['train', 'valid_seen', 'valid_unseen']"
        in res.stderr
    )
    assert not (tmp_path / "x.parquet").exists()
