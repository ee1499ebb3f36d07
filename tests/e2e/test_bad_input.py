"""Every command meets bad input with one line naming the file or flag (exit 2: usage, 1: runtime),
and a run with a damaged shard and a damaged checkpoint stays readable: the readers skip what is
damaged, say so, and carry on (``--strict`` makes it an error)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agent_r1.agent.episode import EpisodeSettings


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """The real entry point in its own process."""
    return subprocess.run(
        [sys.executable, "-m", "agent_r1.cli", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture
def cli(capsys):
    """``agent-r1 ARGS`` in this process (no interpreter start per call): exit code and output; an
    unexpected exception fails the test with its traceback."""
    import logging

    import agent_r1.logging as project_logging
    from agent_r1.cli import main

    def run(*args: str) -> subprocess.CompletedProcess:
        # as a fresh process starts: the project's logger unconfigured (an earlier command's
        # handler would write to an earlier test's captured stdout)
        root = logging.getLogger("agent_r1")
        for h in list(root.handlers):
            root.removeHandler(h)
        root.propagate, project_logging._CONFIGURED = True, False
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse's usage errors
            code = e.code
        out = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out.out, out.err)

    return run


def _processes_naming(marker: str) -> list[str]:
    """Command lines of live processes that mention ``marker`` (a test's tmp path)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd and int(pid) != os.getpid():
            found.append(cmd)
    return found


def one_line_error(r: subprocess.CompletedProcess, code: int, says: str) -> str:
    """The command failed with ``code`` and said ``says`` in one line of its own, no traceback."""
    assert r.returncode == code, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert "Traceback" not in r.stderr + r.stdout, r.stderr[-3000:]
    errors = [x for x in r.stderr.splitlines() if x.startswith("agent-r1")]
    assert len(errors) == 1 and says in errors[0], r.stderr[-2000:]
    return errors[0]


# ---- records ------------------------------------------------------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> Path:
    from agent_r1.records.shard import finalize_iteration, write_shard
    from agent_r1.records.synth import synth_table

    for it in range(3):
        write_shard(tmp_path / "recs", it, 0, synth_table(4, id_prefix=f"it{it}"), "none")
        finalize_iteration(tmp_path / "recs", it)
    return tmp_path / "recs"


def _shard(store: Path, it: int) -> Path:
    return sorted((store / f"iter_{it:06d}").glob("shard_*.arrow"))[0]


@pytest.mark.parametrize("damage", ["truncated", "zero_length", "random_bytes"])
def test_records_stats_and_show_skip_a_damaged_iteration(store: Path, damage: str, cli):
    shard = _shard(store, 1)
    size = shard.stat().st_size
    shard.write_bytes({"truncated": shard.read_bytes()[: size // 2], "zero_length": b"",
                       "random_bytes": os.urandom(size)}[damage])  # fmt: skip
    r = cli("records", "stats", str(store))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    stats = json.loads(r.stdout)
    assert stats["iter_000000"]["steps"] > 0 and stats["iter_000002"]["steps"] > 0
    assert str(shard) in stats["iter_000001"]["damaged"]
    assert f"warning: skipping damaged iteration 1: {shard}" in r.stderr
    one_line_error(_cli("records", "stats", "--strict", str(store)), 1, str(shard))  # the real entry point
    # show: the newest intact iteration by default; the damaged one asked for by number is an error
    r = cli("records", "show", str(store))
    assert r.returncode == 0 and r.stdout.startswith("trajectory it2-"), r.stderr[-2000:]
    one_line_error(cli("records", "show", str(store), "--iteration", "1"), 1, str(shard))
    _shard(store, 2).write_bytes(b"")
    r = cli("records", "show", str(store))
    assert r.returncode == 0 and "iteration 0" in r.stdout.splitlines()[0], r.stderr[-2000:]


def test_records_name_what_is_missing(store: Path, tmp_path: Path, cli):
    one_line_error(
        cli("records", "stats", str(tmp_path / "nope")), 1, f"no records directory at {tmp_path / 'nope'}"
    )
    manifest = store / "iter_000000" / "manifest.json"
    one_line_error(cli("records", "show", str(manifest)), 1, f"no records directory at {manifest}")
    one_line_error(
        cli("records", "show", str(store), "--iteration", "999"),
        1,
        "no finalized iteration 999 (have 0, 1, 2)",
    )
    one_line_error(
        cli("records", "show", str(store), "--iteration", "-1"), 2, "argument --iteration: must be >= 0"
    )


# ---- arguments and config values ----------------------------------------------------------------


@pytest.mark.parametrize(
    "args, says",
    [
        (["eval", "--n", "0"], "argument --n: must be >= 1, got 0"),
        (["eval", "--num", "-1"], "argument --num: must be >= 1, got -1"),
        (["eval", "--temperature", "nan"], "argument --temperature: must be a finite number, got 'nan'"),
        (["eval", "--top-p", "1.5"], "argument --top-p: must be in (0, 1], got 1.5"),
        (["infer", "--input", "x", "--out", "y", "--n", "abc"], "argument --n: must be an integer, got 'abc'"),
        (["serve", "--model", "x", "--port", "70000"], "argument --port: must be a port in 0..65535"),
        (["train", "+experiment=quickstart", "optim.lr=inf"], "optim.lr: must be a finite number, got inf"),
        (["train", "+experiment=quickstart", "trainer.timeout_s=-1"], "trainer.timeout_s: must be > 0 seconds"),

    ],
)  # fmt: skip
def test_nonsense_is_refused_before_anything_starts(args, says, tiny_model_dir: Path, tmp_path: Path, cli):
    if args[0] == "eval":
        args = [*args, "--model", str(tiny_model_dir), "--out", str(tmp_path / "out")]
    if args[0] == "train":
        args = [*args, f"trainer.run_dir={tmp_path / 'run'}"]
    one_line_error(cli(*args), 2, says)
    assert not (tmp_path / "out").exists() and not (tmp_path / "run").exists()
    assert not _processes_naming(str(tmp_path))


def test_eval_budgets_must_fit_the_servers_context(tiny_model_dir: Path, tmp_path: Path, cli):
    r = cli("eval", "--model", str(tiny_model_dir), "--max-obs-tokens", "2000", "--max-action-tokens", "100",
             "--max-len", "2048", "--out", str(tmp_path / "out"))  # fmt: skip
    one_line_error(r, 2, "--max-obs-tokens 2000 + --max-action-tokens 100 do not fit --max-len 2048")
    assert not _processes_naming(str(tmp_path))


@pytest.mark.parametrize(
    "content, says",
    [
        (b'{"prompt": "caf\xe9 au lait"}\n', "bad.jsonl:1: not UTF-8 text (byte 15: b'\\xe9')"),
        (b'{"prompt": "2+2?", "ground_truth": NaN}\n', "bad.jsonl:1: ground_truth must be a string, a finite number"),
        (b"\n" + json.dumps({"prompt": "word " * 10_000_000}).encode() + b"\n",
         "bad.jsonl:2: the prompt (50000000 characters, at least"),
    ],
    ids=["not_utf8", "nan_ground_truth", "a_50_MB_line"],
)  # fmt: skip
def test_infer_names_the_bad_line_before_any_server_starts(content, says, tiny_model_dir, tmp_path, cli):
    (tmp_path / "bad.jsonl").write_bytes(content)
    r = cli("infer", "--model", str(tiny_model_dir), "--input", str(tmp_path / "bad.jsonl"),
            "--out", str(tmp_path / "o.jsonl"))  # fmt: skip
    line = one_line_error(r, 1, says)
    budget = EpisodeSettings.max_obs_tokens  # the one default of every command
    assert f"cannot fit --max-obs-tokens {budget}" in line or "characters" not in says
    assert not (tmp_path / "o.jsonl").exists() and not _processes_naming(str(tmp_path))


# ---- a trained run with a damaged shard and a damaged checkpoint ------------------------------------


@pytest.fixture
def damaged_run(copy_run) -> Path:
    run = copy_run("damaged")
    shard = _shard(run / "records", 1)
    with shard.open("r+b") as f:  # a few bytes overwritten in place: same size, wrong checksum
        f.seek(1000)
        f.write(b"garbage")
    with (run / "checkpoints" / "iter_000001" / "__0_0.distcp").open("r+b") as f:
        f.seek(100)
        f.write(b"garbage")
    return run


def test_a_damaged_run_still_shows_its_other_iterations(damaged_run: Path, tmp_path: Path, cli):
    from agent_r1.viewer import collect

    r = cli("records", "stats", str(damaged_run))
    stats = json.loads(r.stdout)
    assert stats["iter_000000"]["steps"] > 0 and "checksum mismatch" in stats["iter_000001"]["damaged"]
    out = tmp_path / "view.html"
    r = cli("view", str(damaged_run), "--out", str(out))
    assert r.returncode == 0 and out.exists(), r.stderr[-2000:]
    page = collect(damaged_run)
    train_its = {x["it"]: x for x in page["iterations"] if x["kind"] == "train"}
    assert "checksum mismatch" in train_its[1]["damaged"] and train_its[0]["total"] > 0
    assert all(t["it"] != 1 for t in page["trajs"] if t["kind"] == "train")
    assert (
        "damaged, not shown" in (Path(__file__).parents[2] / "agent_r1/viewer_assets/viewer.js").read_text()
    )
    one_line_error(cli("view", str(damaged_run), "--strict", "--out", str(out)), 1, "checksum mismatch")


def test_eval_of_a_damaged_run_takes_the_newest_intact_checkpoint(damaged_run: Path, tmp_path: Path, cli):
    r = _cli(
        "eval", "--run", str(damaged_run), "--no-progress", "--out", str(tmp_path / "ev")
    )  # real process
    assert r.returncode == 0, r.stderr[-3000:]
    log = r.stdout + r.stderr
    assert "skipping damaged checkpoint" in log and "__0_0.distcp does not match its checksum" in log
    assert "the newest intact checkpoint (damaged: iter_000001)" in log
    assert json.loads((tmp_path / "ev" / "metrics.json").read_text())["model"].endswith("iter_000000")
    one_line_error(
        cli("eval", "--run", str(damaged_run), "--strict", "--out", str(tmp_path / "ev2")), 1, "__0_0.distcp"
    )
    # every checkpoint damaged: one line, and nothing started
    copy = tmp_path / "copy"
    shutil.copytree(damaged_run, copy, ignore=shutil.ignore_patterns("evals"))
    (copy / "checkpoints" / "iter_000000" / "common.pt").write_bytes(b"torn")
    one_line_error(cli("eval", "--run", str(copy), "--out", str(tmp_path / "ev3")), 1,
                   "every checkpoint is damaged (iter_000001, iter_000000)")  # fmt: skip
    assert not _processes_naming(str(tmp_path))
    # a torn config.yaml is named, not read as a shorter config with defaults
    text = (copy / "config.yaml").read_text()
    (copy / "config.yaml").write_text(
        text[: text.rindex("\n", 0, len(text) // 3) + 1]
    )  # whole lines: valid YAML
    one_line_error(cli("eval", "--run", str(copy), "--out", str(tmp_path / "ev4")), 2,
                   f"{copy / 'config.yaml'}: incomplete")  # fmt: skip
    (copy / "config.yaml").write_text(text + "  bad: [unclosed\n")
    one_line_error(
        cli("eval", "--run", str(copy), "--out", str(tmp_path / "ev4")), 2, "not a readable config"
    )


def test_debug_shows_the_traceback(tmp_path: Path):
    from agent_r1.cli import main

    assert main(["records", "stats", str(tmp_path / "nope")]) == 1
    with pytest.raises(FileNotFoundError, match="no records directory"):
        main(["--debug", "records", "stats", str(tmp_path / "nope")])


def test_an_action_budget_over_the_context_is_refused_before_any_role(tiny_model_dir: Path, tmp_path: Path):
    """``episode.max_action_tokens=100000`` with ``model.max_len=2048``: the run's preflight refuses it
    (with every other problem), no role starts."""
    r = _cli("train", "+experiment=quickstart", f"model.path={tiny_model_dir}", "model.build=null",
             f"trainer.run_dir={tmp_path / 'run'}", "episode.max_action_tokens=100000", timeout=120)  # fmt: skip
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "episode.max_action_tokens=100000 = 100512 must fit model.max_len=2048" in r.stderr
    assert not list((tmp_path / "run" / "control" / "roles").glob("*.json"))
    assert not _processes_naming(str(tmp_path))
