"""One short training run per search recipe, as a user starts it (the preset with a few
overrides): the launcher builds the model and the index, starts the retriever role, the agents
search through it, and the run finishes with task metrics logged."""

from __future__ import annotations

import json

from train_checks import check_finished, read_records, reduced, train

from agent_r1.train.plot import read_scalars


def _short(preset: str, tmp_path, *extra: str) -> list[str]:
    return reduced(
        tmp_path / "model", tmp_path / "run", f"retrieval.index={tmp_path}/index", *extra,
        preset=preset, build=True, demos=64, action_tokens=None,
    )  # fmt: skip


def test_hotpotqa_steppo_short_run(tmp_path):
    r = train(_short("hotpotqa_steppo", tmp_path))
    run = tmp_path / "run"
    s = check_finished(r, run, 2)
    assert s["algorithm"] == "steppo"
    meta = json.loads((tmp_path / "index" / "meta.json").read_text())
    assert meta["passages"] > 300 and meta["source"].startswith("recipe hotpotqa seed 0")
    # the warm start's demonstrations searched through the run's retriever role (the learner),
    # and the workers' search tools use it too
    assert "retriever for" in (run / "logs" / "retriever_0.log").read_text()
    sft = read_records(run, 0, "sft_records")
    calls = [c for x in sft.column("info").to_pylist() for c in json.loads(x).get("tool_calls", [])]
    assert calls and all(c["name"] == "search" and c["hits"] and not c["error"] for c in calls), calls[:3]
    assert "search tools use the run's retriever at http://" in (run / "logs" / "worker_0.log").read_text()
    scalars = read_scalars(run / "tensorboard")
    for tag in ("eval/em", "eval/f1", "rollout/f1", "critic/value_loss"):
        assert tag in scalars, sorted(scalars)
    assert all(0.0 <= v <= 1.0 for _, v in scalars["eval/f1"])


def test_paper_search_pspo_short_run(tmp_path):
    """With the LLM judge as the selector: the helper model ``selector`` (here the run's own
    starting model), served by the launcher's selector role."""
    extra = ["+recipe.env.selector=llm", f"+rollout.helpers.selector={tmp_path}/model"]
    r = train(_short("paper_search_pspo", tmp_path, *extra))
    run = tmp_path / "run"
    s = check_finished(r, run, 2)
    assert s["algorithm"] == "pspo"
    assert "serving" in (run / "logs" / "selector_0.log").read_text()
    assert "helper models of the run: selector" in (run / "logs" / "worker_0.log").read_text()
    # process rewards: every step of a trajectory is paid; recall and F1 are logged
    table = read_records(run, 0)
    assert table.num_rows > 0 and all(x is not None for x in table.column("reward").to_pylist())
    scalars = read_scalars(run / "tensorboard")
    for tag in ("eval/recall", "eval/f1", "rollout/recall", "critic/value_loss", "loss/kl"):
        assert tag in scalars, sorted(scalars)
    assert "retriever for" in (run / "logs" / "retriever_0.log").read_text()
    sft = read_records(run, 0, "sft_records")
    names = [c["name"] for x in sft.column("info").to_pylist() for c in json.loads(x).get("tool_calls", [])]
    assert set(names) == {"search", "expand"}
    # the demonstrations' process rewards came from the judge (the lexical selector pays each of
    # their steps exactly 3): sums of the top-3 P(Yes) of a barely trained model
    paid = [r for r in sft.column("reward").to_pylist() if r]
    assert paid and all(0.0 < r < 3.0 for r in paid) and len(set(paid)) > 1, paid[:8]
