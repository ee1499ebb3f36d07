"""Episode budgets are declared once (``EpisodeSettings``): training, evaluation, inference, chat
and ``agent-r1 rollout`` read their defaults from it, and a run's commands use the run's settings."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest

from agent_r1.agent.episode import GREEDY, EpisodeSettings, FlowConfig
from agent_r1.cli import build_parser
from agent_r1.commands.policy_source import episode_settings
from agent_r1.train.config import TrainConfig, load_config

COMMANDS = [
    ["rollout", "--model", "m"],
    ["eval", "--model", "m"],
    ["infer", "--input", "x.jsonl", "--out", "y.jsonl", "--model", "m"],
    ["chat", "--model", "m"],
]


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: a[0])
def test_every_command_defaults_to_the_one_slice(argv):
    a = build_parser().parse_args(argv)
    assert episode_settings(a, None) == replace(EpisodeSettings(), temperature=GREEDY)
    a = build_parser().parse_args(
        [*argv, "--max-steps", "2", "--max-action-tokens", "9", "--temperature", "0.5"]
    )
    got = episode_settings(a, None)
    assert (got.max_steps, got.max_obs_tokens, got.max_action_tokens, got.temperature) == (
        2, EpisodeSettings.max_obs_tokens, 9, 0.5,
    )  # fmt: skip


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: a[0])
def test_with_a_run_every_command_uses_the_runs_settings(argv):
    cfg = load_config(["+experiment=quickstart", "trainer.eval_temperature=0.25"])
    a = build_parser().parse_args(argv)
    assert episode_settings(a, cfg) == replace(cfg.episode, temperature=0.25, top_p=1.0)
    assert cfg.episode.max_obs_tokens == 512  # the preset's, not the defaults
    a = build_parser().parse_args([*argv, "--max-obs-tokens", "300"])
    assert episode_settings(a, cfg).max_obs_tokens == 300


def test_the_training_config_and_flows_take_their_defaults_from_the_slice():
    assert TrainConfig().episode == EpisodeSettings()
    flow, s = FlowConfig(), EpisodeSettings()
    assert (flow.max_steps, flow.max_obs_tokens, flow.max_action_tokens) == (
        s.max_steps, s.max_obs_tokens, s.max_action_tokens,
    )  # fmt: skip
    assert {f.name for f in fields(EpisodeSettings)} == {
        "max_steps", "max_obs_tokens", "max_action_tokens", "temperature", "top_p",
    }  # fmt: skip


@pytest.mark.parametrize(
    "values, msg",
    [
        ({"max_steps": 0}, "episode.max_steps: must be >= 1"),
        ({"top_p": 0.0}, "episode.top_p: must be in (0, 1]"),
        ({"temperature": -1.0}, "episode.temperature: must be >= 0"),
        ({"max_step": 3}, "no setting named 'max_step'"),
    ],
)
def test_bad_settings_name_the_key(values, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        EpisodeSettings().with_values(values)


def test_flow_configs_are_built_in_one_place():
    import re
    from pathlib import Path

    pkg = Path(__file__).resolve().parents[2] / "agent_r1"
    built = {
        str(p.relative_to(pkg)): len(re.findall(r"(?<!class )\bFlowConfig\(", p.read_text()))
        for p in pkg.rglob("*.py")
    }
    assert {k: v for k, v in built.items() if v} == {"agent/episode.py": 1}
