"""Training config: every preset composes and validates; bad keys and values fail naming the key."""

from pathlib import Path

import pytest

from agent_r1.train.config import CONFIG_DIR, ConfigError, TrainConfig, from_yaml, load_config, to_yaml

PRESETS = sorted(p.stem for p in (CONFIG_DIR / "experiment").glob("*.yaml"))
ALGORITHMS = sorted(p.stem for p in (CONFIG_DIR / "algorithm").glob("*.yaml"))


def test_presets_exist():
    assert {"quickstart", "smollm2_gsm8k_tool", "qwen3_4b_gsm8k_tool_steppo_4n8g"} <= set(PRESETS)
    assert {"grpo", "rloo", "reinforce_pp", "ppo", "steppo", "pspo", "gigpo", "opd"} <= set(ALGORITHMS)


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_composes_and_validates(preset):
    cfg = load_config([f"+experiment={preset}"])
    assert isinstance(cfg, TrainConfig)
    assert cfg.trainer.name == preset  # each preset names its runs
    assert cfg.parallel.learner_ranks % (cfg.parallel.tp * cfg.parallel.pp) == 0


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_algorithm_group_composes(algorithm):
    cfg = load_config([f"algorithm={algorithm}"])
    assert cfg.algorithm.name == algorithm
    from agent_r1.algos.advantages import ADVANTAGES
    from agent_r1.algos.losses import POLICY_LOSSES

    assert cfg.algorithm.advantage in ADVANTAGES and cfg.algorithm.loss in POLICY_LOSSES


def test_cluster_preset_values():
    cfg = load_config(["+experiment=qwen3_4b_gsm8k_tool_steppo_4n8g"])
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.backend) == (2, 2, 8, "nccl")
    assert (
        cfg.cluster.launcher == "slurm" and cfg.cluster.gpus_per_node == 8 and cfg.cluster.learner_nodes == 4
    )
    assert cfg.rollout.engine == "sglang" and cfg.algorithm.loss == "steppo"
    assert cfg.model.precision == "fp8"
    # the learner ranks fill the learner nodes' GPUs exactly
    assert cfg.parallel.learner_ranks == cfg.cluster.learner_nodes * cfg.cluster.gpus_per_node


def test_overrides_apply():
    cfg = load_config(["+experiment=quickstart", "algorithm=steppo", "rollout.group_size=4", "optim.lr=0.5"])
    assert cfg.algorithm.loss == "steppo" and cfg.rollout.group_size == 4 and cfg.optim.lr == 0.5
    assert cfg.sft.steps > 0 and cfg.recipe.name == "arithmetic_tool"


@pytest.mark.parametrize(
    "override, names",
    [
        ("trainer.itertions=3", "trainer.itertions"),  # a typo
        ("+rollout.nope=1", "nope"),
        ("rollout.group_size=abc", "rollout.group_size"),
        ("rollout.mode=sometimes", "rollout.mode"),
        ("algorithm.policy.agg=mean", "agg"),
        ("algorithm.advantage=nope", "algorithm.advantage"),
        ("parallel.learner_ranks=3 parallel.tp=2", "parallel.learner_ranks"),
        ("parallel.learner_ranks=4 parallel.ep=3", "parallel.ep: must divide the tp * cp * dp = 4 ranks"),
        ("parallel.sp=true", "parallel.sp: sequence parallelism splits tokens over the tensor-parallel"),
        ("parallel.vpp=2", "parallel.vpp: must be >= 1, and > 1 only with parallel.pp > 1"),
        (
            "parallel.cp=2 parallel.learner_ranks=3",
            "parallel.learner_ranks: must be a multiple of tp*pp*cp = 2",
        ),
        ("algorithm=nope", "algorithm"),
        ("algorithm.estimator.gamma=0", "gamma"),
        ("episode.top_p=1.5", "episode.top_p"),
        ("rollout.max_steps=3", "rollout.max_steps moved to episode.max_steps"),
        ("episode.max_obs_tokens=0", "episode.max_obs_tokens: must be >= 1"),
        ("trainer.resume=/no/such/checkpoint", "trainer.resume"),
        ("algorithm=ppo algorithm.critic=false", "algorithm.critic"),
        ("algorithm.policy.kl_coef=0.1", "algorithm.reference"),
        ("model.dtype=float16", "model.dtype"),
        ("model.fp8_recipe=bogus", "model.fp8_recipe"),
        ("trainer.deterministic=true rollout.mode=stream", "trainer.deterministic: needs rollout.mode=sync"),
        (
            "trainer.deterministic=true rollout=vllm",
            "do not depend on their batch (embedded); got sync, vllm",
        ),
        (
            "trainer.deterministic=true parallel.learner_ranks=2 parallel.pp=2",
            "trainer.deterministic: takes the policy's logprob values from the engine's forward",
        ),
        ("optim.share_prefix=-1", "optim.share_prefix must be >= 0"),
        (
            "optim.share_prefix=16 parallel.learner_ranks=2 parallel.cp=2",
            "optim.share_prefix: packs branches of a shared prefix",
        ),
    ],
)
def test_bad_config_fails_naming_the_key(override, names):
    with pytest.raises(ConfigError) as e:
        load_config(override.split())
    assert names in str(e.value), str(e.value)


def test_opd_needs_a_teacher():
    with pytest.raises(ConfigError, match="algorithm.teacher"):
        load_config(["algorithm=opd", "algorithm.teacher=null"])
    assert load_config(["algorithm=opd", "algorithm.teacher=/x"]).algorithm.teacher == "/x"


def test_resolved_config_round_trips(tmp_path: Path):
    cfg = load_config(["+experiment=quickstart", "algorithm=pspo"])
    p = tmp_path / "config.yaml"
    p.write_text(to_yaml(cfg))
    assert from_yaml(p) == cfg
    p.write_text(to_yaml(cfg).replace("group_size:", "group_sise:"))
    with pytest.raises(ConfigError, match="group_sise"):
        from_yaml(p)


def test_cli_reports_bad_key(capsys):
    from agent_r1.cli import main

    assert main(["train", "trainer.itertions=3"]) == 2
    assert "trainer.itertions" in capsys.readouterr().err


def test_search_presets_resolve_to_the_seed_definitions():
    h = load_config(["+experiment=hotpotqa_steppo"])
    assert (h.algorithm.advantage, h.algorithm.loss, h.algorithm.critic) == ("gae", "steppo", True)
    assert h.recipe.name == "hotpotqa" and h.retrieval.index and h.retrieval.serve
    p = load_config(["+experiment=paper_search_pspo"])
    a = p.algorithm
    assert (a.advantage, a.loss, a.critic, a.reference) == ("gae", "pspo", True, True)
    assert (a.policy.clip_low, a.policy.clip_high, a.policy.clip_c, a.policy.kl_coef) == (
        3e-4,
        4e-4,
        10.0,
        0.001,
    )
    assert p.recipe.name == "paper_search" and p.retrieval.index
    c = load_config(["+experiment=qwen3_4b_paper_search_pspo_4n8g"]).algorithm
    assert c.loss == "pspo" and c.reward_scaling


@pytest.mark.parametrize("preset", ["qwen3_4b_hotpotqa_steppo_4n8g", "qwen3_4b_paper_search_pspo_4n8g"])
def test_cluster_search_presets_place_the_retriever_on_the_rollout_nodes(preset, tmp_path):
    from agent_r1.launch.slurm import render_job
    from agent_r1.train.run_dir import RunDir

    cfg = load_config([f"+experiment={preset}", f"trainer.run_dir={tmp_path}/run"])
    script = render_job(cfg, RunDir.at(tmp_path / "run").create())
    line = next(x for x in script.splitlines() if " role retriever " in x)
    assert "--het-group=1" in line and "--supervise" in line  # the rollout component, restarted in place


def test_async_rollouts_turn_the_decoupled_objective_on_unless_told_otherwise():
    """Rollouts up to max_staleness versions old train with the truncated behaviour weight (cap 2)
    by default; sync runs do not need it; a set cap wins, and 0 turns it off."""
    assert load_config(["rollout.mode=async"]).algorithm.policy.tis_cap == 2.0
    assert load_config([]).algorithm.policy.tis_cap is None
    assert load_config(["rollout.mode=async", "rollout.max_staleness=0"]).algorithm.policy.tis_cap is None
    assert load_config(["rollout.mode=async", "algorithm.policy.tis_cap=0"]).algorithm.policy.tis_cap == 0
    assert load_config(["rollout.mode=async", "algorithm.policy.tis_cap=5"]).algorithm.policy.tis_cap == 5
