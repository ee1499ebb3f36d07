"""`agent-r1 infer`: open prompts and data rows from hand-written files, answers as JSON lines,
scored where a ground truth is given, resumed after a cut, the same answers over two servers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from agent_r1.commands.infer import read_inputs
from agent_r1.data.rows import RowError, write_rows
from recipes import load_recipe


def _lines(tmp_path, name="prompts.jsonl"):
    p = tmp_path / name
    recs = [
        {"id": "a", "prompt": "Kai has 14 beads and doubles them. How many now?", "ground_truth": "28"},
        {"id": "b", "messages": [{"role": "user", "content": "What is 6 * 7?"}]},
        {"prompt": "What is 3 + 4?", "ground_truth": "7"},
    ]
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return p


def test_open_prompts_take_the_recipes_agent(tmp_path):
    rows = read_inputs(_lines(tmp_path), recipe="arithmetic_tool")
    want = load_recipe("arithmetic_tool").build_rows(split="test", num=1, seed=0)[0]
    assert [r.agent_name for r in rows] == ["arithmetic_tool"] * 3
    assert rows[0].prompt[0] == want.prompt[0] and rows[0].prompt[1]["content"].startswith("Kai has")
    assert rows[0].reward_model == {"style": "math_number", "ground_truth": "28"}
    assert rows[1].reward_model["style"] == "unscored" and rows[0].extra_info == {"id": "a"}
    tool_rows = read_inputs(_lines(tmp_path), tools=["calculator"])
    assert tool_rows[0].agent_name == "tool_agent" and tool_rows[0].env_kwargs == {"tools": ["calculator"]}
    assert tool_rows[0].reward_model["style"] == "unscored"  # no recipe: nothing to score against
    # data rows pass through, in parquet or as JSON lines
    data = load_recipe("arithmetic_tool").build_rows(split="test", num=2, seed=0)
    assert read_inputs(write_rows(data, tmp_path / "rows.parquet")) == data
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r.to_dict()) + "\n" for r in data))
    assert read_inputs(tmp_path / "rows.jsonl") == data


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('{"prompt": ""}\n', "bad.jsonl:1: needs a non-empty 'prompt'"),
        ('{"prompt": "x"}\n{"messages": [{"role": "robot", "content": "x"}]}\n', "bad.jsonl:2: messages[0]"),
        ('{"prompt": "x"}\nnot json\n', "bad.jsonl:2: not JSON"),
        (
            '{"agent_name": "nobody", "prompt": [], "reward_model": {}, "env_kwargs": "", "data_source": ""}\n',
            "bad.jsonl:1",
        ),
    ],
)
def test_bad_input_records_name_file_and_line(tmp_path, text, says):
    (tmp_path / "bad.jsonl").write_text(text)
    with pytest.raises(RowError, match=says.replace("[", r"\[").replace("]", r"\]")):
        read_inputs(tmp_path / "bad.jsonl", recipe="arithmetic_tool")


def _infer(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "agent_r1.cli", "infer", "--no-progress", "--max-steps", "2",
         "--max-action-tokens", "24", "--chunk", "2", *args],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_infer_writes_resumes_and_spreads_over_servers(tiny_model_dir, tmp_path):
    src = _lines(tmp_path)
    out = tmp_path / "answers.jsonl"
    base = ["--model", str(tiny_model_dir), "--input", str(src), "--recipe", "arithmetic_tool", "--n", "2"]
    r = _infer(*base, "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted((x["index"], x["sample"]) for x in lines) == [(i, k) for i in range(3) for k in range(2)]
    by = {(x["index"], x["sample"]): x for x in lines}
    assert by[(0, 0)]["id"] == "a" and by[(2, 0)]["id"] == 2
    assert by[(0, 0)]["reward"] is not None and by[(1, 0)]["reward"] is None and by[(1, 0)]["success"] is None
    assert all(1 <= x["steps"] <= 2 and isinstance(x["answer"], str) for x in lines)
    # resume: a run cut inside prompt 2 (its second sample lost, a torn line) redoes prompt 2 only
    keep = [
        x for x in out.read_text().splitlines() if json.loads(x)["index"] != 2 or json.loads(x)["sample"] == 0
    ]
    out.write_text("\n".join(keep) + '\n{"index": 2, "sam')
    r = _infer(*base, "--out", str(out))
    assert r.returncode == 0 and "(1 new" in r.stdout, r.stdout + r.stderr[-2000:]

    def canon(xs):
        return sorted(json.dumps(x, sort_keys=True) for x in xs)

    assert canon(map(json.loads, out.read_text().splitlines())) == canon(lines)  # greedy: the same answers
    # greedy answers do not depend on how many servers share the work
    out2 = tmp_path / "two.jsonl"
    r = _infer(*base, "--out", str(out2), "--servers", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    two = {(x["index"], x["sample"]): x["answer"] for x in map(json.loads, out2.read_text().splitlines())}
    assert two == {k: v["answer"] for k, v in by.items()}


def test_infer_errors_are_one_line(tmp_path, tiny_model_dir):
    r = _infer("--model", str(tmp_path), "--input", str(_lines(tmp_path)), "--out", str(tmp_path / "o.jsonl"))
    assert (
        r.returncode != 0
        and "not an HF model folder (no config.json)" in r.stderr
        and "Traceback" not in r.stderr
    )
    r = _infer("--model", str(tiny_model_dir), "--input", str(_lines(tmp_path)), "--tools", "nope",
               "--out", str(tmp_path / "o.jsonl"))  # fmt: skip
    assert r.returncode != 0 and "--tools: no tool named 'nope'" in r.stderr and "Traceback" not in r.stderr
    (tmp_path / "bad.jsonl").write_text('{"prompt": 3}\n')
    r = _infer(
        "--model",
        str(tiny_model_dir),
        "--input",
        str(tmp_path / "bad.jsonl"),
        "--out",
        str(tmp_path / "o.jsonl"),
    )
    assert (
        r.returncode != 0
        and "bad.jsonl:1: needs a non-empty 'prompt'" in r.stderr
        and "Traceback" not in r.stderr
    )
