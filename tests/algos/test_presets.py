"""Algorithm presets resolve to the seed's definitions; one source of truth for loss
hyper-parameters (the registry's defaults fill what the config leaves unset, an explicit setting
wins, a conflict with what a loss forces is an error naming both); the table in docs/architecture.md says what
the resolved configs say."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from agent_r1.train.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]


def test_steppo_is_step_gae_with_a_critic_and_a_gspo_ratio():
    a = load_config(["algorithm=steppo"]).algorithm
    assert (a.advantage, a.loss, a.critic) == ("gae", "steppo", True)
    assert a.policy.agg == "seq-mean-token-mean"
    assert (a.policy.clip_low, a.policy.clip_high) == (0.2, 0.2)  # verl's default, as the seed's scripts
    assert a.policy.kl_coef == 0.0 and not a.reference


def test_pspo_is_steppo_with_the_tight_clip_and_a_k3_kl():
    a = load_config(["algorithm=pspo"]).algorithm
    assert (a.advantage, a.loss, a.critic, a.reference) == ("gae", "pspo", True, True)
    p = a.policy
    assert (p.clip_low, p.clip_high, p.clip_c) == (3e-4, 4e-4, 10.0)
    assert (p.agg, p.kl_coef, p.kl_estimator) == ("seq-mean-token-mean", 0.001, "k3")
    assert a.reward_scaling is False  # optional
    assert load_config(["algorithm=pspo", "algorithm.reward_scaling=true"]).algorithm.reward_scaling


def test_the_loss_alone_brings_its_defaults():
    p = load_config(["algorithm.loss=pspo"]).algorithm.policy
    assert (p.clip_low, p.clip_high, p.clip_c, p.agg) == (3e-4, 4e-4, 10.0, "seq-mean-token-mean")
    p = load_config(["algorithm.loss=ppo"]).algorithm.policy
    assert (p.clip_low, p.clip_high, p.clip_c, p.agg) == (0.2, 0.2, 3.0, "token-mean")


def test_an_explicit_setting_wins_over_the_loss_default():
    p = load_config(["algorithm=pspo", "algorithm.policy.clip_high=0.001"]).algorithm.policy
    assert (p.clip_low, p.clip_high) == (3e-4, 0.001)


def test_a_conflict_with_a_forced_setting_names_both():
    with pytest.raises(
        ConfigError, match=r"algorithm.policy.agg=token-mean.*algorithm.loss=steppo.*seq-mean-token-mean"
    ):
        load_config(["algorithm=steppo", "algorithm.policy.agg=token-mean"])


def test_print_config_shows_the_resolved_values():
    out = subprocess.run(
        [sys.executable, "-m", "agent_r1.cli", "train", "algorithm.loss=pspo", "--print-config"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    policy = out[out.index("  policy:") :]
    assert (
        "clip_low: 0.0003" in policy
        and "clip_high: 0.0004" in policy
        and "agg: seq-mean-token-mean" in policy
    )


def _readme_rows() -> dict[str, list[str]]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text[text.index("| preset | estimator |") :].split("\n\n")[0]
    rows = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip().strip("`") for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def test_the_docs_table_matches_the_resolved_presets():
    rows = _readme_rows()
    presets = sorted(p.stem for p in (ROOT / "configs" / "algorithm").glob("*.yaml"))
    assert sorted(rows) == presets
    for name in presets:
        a = load_config([f"algorithm={name}"]).algorithm
        p = a.policy
        estimator, loss, agg, clip, kl, critic = rows[name]
        assert (estimator, loss, agg) == (a.advantage, a.loss, p.agg), name
        want_clip = f"{p.clip_low:g} / {p.clip_high:g}" + (
            f", c={p.clip_c:g}" if p.clip_c and loss in ("ppo", "grpo", "opd") else ""
        )
        assert clip == want_clip, (name, clip, want_clip)
        assert kl == (f"{p.kl_coef:g} ({p.kl_estimator})" if p.kl_coef else "—"), name
        assert critic == ("yes" if a.critic else "no"), name
        assert re.fullmatch(r"[a-z_+]+", estimator)
