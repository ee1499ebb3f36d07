"""The real SGLang launch command from the run's config (SGLang itself needs GPUs: not run here)."""

import pytest

from agent_r1.engines.sglang import SGLangConfig, sglang_command
from agent_r1.train.config import ConfigError, load_config


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_command_carries_the_config():
    cfg = load_config(["rollout=sglang", "rollout.sglang.tp=2", "rollout.sglang.mem_fraction=0.7",
                       "model.max_len=4096", "model.dtype=bfloat16",
                       "rollout.sglang.extra_args=[--attention-backend,fa3]"])  # fmt: skip
    cmd = sglang_command(
        "/m", "10.0.0.5", 31000, cfg.model.max_len, cfg.model.dtype, cfg.rollout.sglang, "-k3y", "py"
    )
    assert cmd[:3] == ["py", "-m", "sglang.launch_server"]
    assert _flag(cmd, "--model-path") == "/m" and _flag(cmd, "--host") == "10.0.0.5"
    assert _flag(cmd, "--port") == "31000" and _flag(cmd, "--context-length") == "4096"
    assert _flag(cmd, "--dtype") == "bfloat16" and _flag(cmd, "--tp-size") == "2"
    assert _flag(cmd, "--mem-fraction-static") == "0.7"
    assert "--api-key=-k3y" in cmd  # one token: a key starting with "-" is not read as an option
    assert cmd[-2:] == ["--attention-backend", "fa3"]
    assert not any(
        a.startswith("--api-key") for a in sglang_command("/m", "h", 1, 8, "float32", SGLangConfig())
    )


@pytest.mark.parametrize("bad", ["rollout.sglang.tp=0", "rollout.sglang.mem_fraction=1.0"])
def test_bad_values_name_the_key(bad):
    with pytest.raises(ConfigError, match=bad.split("=")[0]):
        load_config([bad])


def test_the_router_command_parses_with_the_routers_own_parser():
    """sglang-router's own argument parser reads the command the run starts it with; the run's API
    key is random URL-safe text and may start with "-" (one launch in 64): it goes as one token."""
    from sglang_router.launch_router import parse_router_args

    from agent_r1.rollout.router import router_command

    cmd = router_command("127.0.0.1", 30555, "cache_aware", "-Ab3_key", python="py")
    assert cmd[:3] == ["py", "-m", "sglang_router.launch_router"]
    args = parse_router_args(cmd[3:])
    assert (args.host, args.port, args.policy, args.api_key) == (
        "127.0.0.1",
        30555,
        "cache_aware",
        "-Ab3_key",
    )
    assert parse_router_args(router_command("127.0.0.1", 30555, "round_robin", None)[3:]).api_key is None
