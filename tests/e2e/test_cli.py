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


def _data(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "agent_r1.cli", "data", *args], capture_output=True, text=True
    )


def test_cli_data_refuses_to_replace_what_is_not_a_file(tmp_path):
    """``--out`` naming a FIFO (or a device: as root, ``--out /dev/full`` had replaced the device
    node with the parquet file) is refused and left as it was."""
    import os
    import stat

    fifo = tmp_path / "rows.parquet"
    os.mkfifo(fifo)
    res = _data("--recipe", "arithmetic_tool", "--num", "4", "--out", str(fifo))
    assert res.returncode == 1 and f"{fifo}: exists and is not a regular file" in res.stderr, res.stderr
    assert stat.S_ISFIFO(fifo.stat().st_mode)


def test_cli_data_names_an_unknown_split(tmp_path):
    res = _data("--recipe", "alfworld", "--split", "bogus", "--out", str(tmp_path / "x.parquet"))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert (
        "agent-r1 data: alfworld: unknown split 'bogus'; known: ['train', 'valid_seen', 'valid_unseen']"
        in res.stderr
    )
    assert not (tmp_path / "x.parquet").exists()


_PRINTS_A_LOT = """
import argparse, sys
from agent_r1 import cli

def build_parser():
    p = argparse.ArgumentParser()
    p.set_defaults(fn=lambda a: [print("x" * 100) for _ in range(100_000)] and 0)
    return p

cli.build_parser = build_parser
sys.exit(cli.main([]))
"""


def test_output_into_a_closed_pipe_ends_quietly():
    """`agent-r1 ... | head`: the command ends with 141 (as if by SIGPIPE) and no traceback, while
    SIGPIPE itself stays ignored (a server must survive a client's hang-up)."""
    p = subprocess.Popen(
        [sys.executable, "-c", _PRINTS_A_LOT], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert p.stdout.readline().strip() == b"x" * 100
    p.stdout.close()  # the reader goes away, as `head` does
    err = p.stderr.read().decode()
    assert p.wait(60) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err
