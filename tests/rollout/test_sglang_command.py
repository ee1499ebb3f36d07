"""The real SGLang launch command from the run's config (SGLang itself needs GPUs: not run here)."""

import pytest

from agent_r1.rollout.sglang import SGLangConfig, sglang_command
from agent_r1.train.config import ConfigError, load_config


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_command_carries_the_config():
    cfg = load_config(["rollout=sglang", "rollout.sglang.tp=2", "rollout.sglang.mem_fraction=0.7",
                       "model.max_len=4096", "model.dtype=bfloat16",
                       "rollout.sglang.extra_args=[--attention-backend,fa3]"])  # fmt: skip
    cmd = sglang_command(
        "/m", "10.0.0.5", 31000, cfg.model.max_len, cfg.model.dtype, cfg.rollout.sglang, "k3y", "py"
    )
    assert cmd[:3] == ["py", "-m", "sglang.launch_server"]
    assert _flag(cmd, "--model-path") == "/m" and _flag(cmd, "--host") == "10.0.0.5"
    assert _flag(cmd, "--port") == "31000" and _flag(cmd, "--context-length") == "4096"
    assert _flag(cmd, "--dtype") == "bfloat16" and _flag(cmd, "--tp-size") == "2"
    assert _flag(cmd, "--mem-fraction-static") == "0.7" and _flag(cmd, "--api-key") == "k3y"
    assert cmd[-2:] == ["--attention-backend", "fa3"]
    assert "--api-key" not in sglang_command("/m", "h", 1, 8, "float32", SGLangConfig())


@pytest.mark.parametrize("bad", ["rollout.sglang.tp=0", "rollout.sglang.mem_fraction=1.0"])
def test_bad_values_name_the_key(bad):
    with pytest.raises(ConfigError, match=bad.split("=")[0]):
        load_config([bad])
