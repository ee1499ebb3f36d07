"""The package's import graph points one way: no cycles between files of ``agent_r1/`` (imports
inside functions included), read with Python's ``ast``."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "agent_r1"
PACKAGES = ("agent_r1", "recipes", "megatron_bridge")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(packages: tuple[str, ...] = ("agent_r1",)) -> dict[str, set[str]]:
    modules = {module_name(p): p for pkg in packages for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            for t in targets:
                # the most specific module of the package the name refers to
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != name and not name.startswith(t + "."):  # a package's own __init__ is no edge
                    graph[name].add(t)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n) :] + [n]
            if n not in state and (c := visit(n)):
                return c
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (c := visit(m)):
            return c
    return None


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_graph_sees_function_local_imports():
    g = import_graph()
    assert "agent_r1.learner.actor" in g["agent_r1.learner.critic"]
    assert g["agent_r1.cli"], "cli imports the rest of the package inside its commands"


def test_no_import_cycles_between_files():
    """Across the package, the recipes and the Megatron bridge (imports inside functions included)."""
    cycle = find_cycle(import_graph(PACKAGES))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_recipes_import_no_layer_above_the_agent():
    """A recipe is built on the agent layer and below: never on training, launching or commands."""
    above = {"train", "launch", "commands", "cli"}
    bad = [
        f"{m} -> {t}"
        for m, targets in import_graph(PACKAGES).items()
        if m.startswith("recipes")
        for t in targets
        if t.startswith("agent_r1.") and t.split(".")[1] in above
    ]
    assert not bad, "\n".join(bad)


# Which folders of agent_r1/ each folder may import (STYLE §4: imports point down). train/ wires
# everything; cli.py and commands/ are entry points. errors.py (the expected-failure base
# classes) is below everything.
ALLOWED = {
    "errors": set(),
    "registry": set(),
    "process": set(),
    "forkserver": set(),
    "cpus": set(),  # the cores a process may use; choosing torch's thread count while running  # children forked from a pre-imported process (agent programs, sandboxed code)
    "vision": set(),
    "native": set(),  # the C++ CPU kernels and their build (imports nothing of the package)
    "algos": {"registry"},
    "records": set(),
    "jsonfiles": set(),
    "checkpoint_names": set(),  # a model's tensors under its checkpoint's names (stacked experts)
    "http_service": {"jsonfiles"},  # the HTTP service kit and the addresses services publish
    # every engine's entry (config, serving, API adapter, weight transport): data, read by any layer
    "engine_spec": set(),
    # the client side of generation: the protocol, the client, SGLang's wire, the router
    "rollout": {"records", "process", "http_service", "engine_spec"},
    # the fifth stage: learner weights -> servers (sender, transports, the receiving routes)
    "weights": {"rollout", "http_service", "engine_spec", "process"},
    # the engines behind the protocol: the embedded engine's package, the upstream servers
    "engines": {
        "rollout",
        "weights",
        "records",
        "process",
        "vision",
        "http_service",
        "checkpoint_names",
        "cpus",
        "native",
        "engine_spec",
    },
    "retrieval": {"jsonfiles", "http_service"},
    "agent_tools": {"registry", "retrieval", "vision", "forkserver"},
    "rewards": {"registry"},
    "data": {"records", "vision"},
    "agent": {"rollout", "records", "data", "agent_tools", "rewards", "registry", "vision"},
    "learner": {"algos", "records", "vision", "checkpoint_names", "cpus", "native"},
    "serving": {"agent", "rollout", "engines", "vision", "http_service"},
    # agent programs through an OpenAI-compatible endpoint: an agent flow built on the serving routes
    "gateway": {"agent", "serving", "records", "data", "vision", "http_service", "forkserver"},
}


def test_folders_import_only_the_layers_below():
    g = import_graph()
    bad = []
    for m, targets in g.items():
        src = m.split(".")[1] if m.count(".") else m
        if src not in ALLOWED:
            continue
        for t in targets:
            dst = t.split(".")[1] if t.count(".") else t
            if dst != src and dst != "errors" and dst not in ALLOWED[src]:
                bad.append(f"{m} -> {t}")
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_training_never_imports_launching_or_the_commands():
    """train/ (loop, learner, coordinator, worker) is below launch/ (launchers, Slurm, roles,
    preflight, plan), which is below commands/ and cli.py."""
    below = {"train": {"launch", "commands", "cli"}, "launch": {"commands", "cli"}}
    bad = [
        f"{m} -> {t}"
        for m, targets in import_graph().items()
        for t in targets
        if m.count(".") and t.count(".") and t.split(".")[1] in below.get(m.split(".")[1], ())
    ]
    assert not bad, "\n".join(bad)


def test_the_five_stages_keep_to_their_rooms():
    """The agent layer generates through the rollout protocol only: it never imports an engine or
    the weight push; the learner never imports the rollout layer, an engine or the weight push
    (weights leave it as tensors, the trainer hands them to ``weights/``)."""
    forbidden = {"agent": {"engines", "weights"}, "learner": {"rollout", "engines", "weights"}}
    bad = [
        f"{m} -> {t}"
        for m, targets in import_graph().items()
        for t in targets
        if m.count(".") and t.count(".") and t.split(".")[1] in forbidden.get(m.split(".")[1], ())
    ]
    assert not bad, "\n".join(bad)


def _code_mentions(path: Path, word: str) -> list[int]:
    """Lines where ``word`` is in code (a name, an attribute, an import, a string that is not a
    docstring), case-insensitively; comments and docstrings are prose and not counted."""
    tree = ast.parse(path.read_text())
    docs = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        and n.body
        and isinstance(n.body[0], ast.Expr)
        and isinstance(n.body[0].value, ast.Constant)
    }
    lines = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
            text = n.value
        elif isinstance(n, ast.Name):
            text = n.id
        elif isinstance(n, ast.Attribute | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            text = n.attr if isinstance(n, ast.Attribute) else n.name
        elif isinstance(n, ast.ImportFrom):
            text = n.module or ""
        elif isinstance(n, ast.alias | ast.keyword | ast.arg):
            text = (n.name if isinstance(n, ast.alias) else n.arg) or ""
        else:
            continue
        if word in text.lower():
            lines.append(n.lineno)
    return sorted(set(lines))


def test_code_mentions_finds_code_and_skips_prose(tmp_path):
    f = tmp_path / "m.py"
    f.write_text(
        '"""vllm in a docstring."""\n# vllm in a comment\nx = "vllm"\nfrom a.vllm import b\nVLLMThing = 1\n'
    )
    assert _code_mentions(f, "vllm") == [3, 4, 5]


def test_an_added_engine_lives_in_its_own_modules_its_config_and_the_registry():
    """vLLM (the engine added beside the project's own): its name is in code only in its serving
    module, its weight transport (the trainer's end; the receiving end inside vLLM, with the plugin
    entry point that registers it, a module of its own because it runs in vLLM's venv where the
    package's dependencies are absent), its launch-flags slice of the config and the engine table:
    five files."""
    allowed = {
        "agent_r1/engine_spec.py",
        "agent_r1/engines/vllm.py",
        "agent_r1/weights/vllm.py",
        "agent_r1/weights/vllm_gloo.py",
        "agent_r1/train/config.py",
    }
    found = {str(p.relative_to(ROOT)) for p in PKG.rglob("*.py") if _code_mentions(p, "vllm")}
    assert found <= allowed, sorted(found - allowed)


def test_sglang_is_named_by_its_engine_its_wire_its_router_and_its_memory_plan():
    """SGLang is two things here: an engine (launched on GPU nodes: its serving module, its update
    protocol, its launch-flags slice, its table entry) and the wire every other engine but vLLM
    speaks (SGLang's native HTTP API: the client's adapter, the embedded server that answers as a
    given SGLang release does and the command that starts it). Besides those, only the real
    ``sglang-router`` (its launcher and the flag that accepts one) and the plan that sizes SGLang
    servers' GPU memory name it; a new mention must be one of these."""
    allowed = {
        # the engine
        "agent_r1/engines/sglang.py",
        "agent_r1/weights/sglang.py",
        "agent_r1/train/config.py",
        "agent_r1/engine_spec.py",
        # the wire
        "agent_r1/rollout/server_api.py",
        "agent_r1/engines/embedded/server.py",
        "agent_r1/commands/serve.py",
        # the router, the memory plan
        "agent_r1/rollout/router.py",
        "agent_r1/commands/flags.py",
        "agent_r1/launch/plan.py",
    }
    found = {str(p.relative_to(ROOT)) for p in PKG.rglob("*.py") if _code_mentions(p, "sglang")}
    assert found <= allowed, sorted(found - allowed)


def test_no_layer_dispatches_on_an_engines_name():
    """Launching, training, the client and the weight sender read an engine's entry in
    ``engine_spec``, never its name: no string equal to an engine's name in their code (the
    engine's own modules name themselves; the config names its default)."""
    from agent_r1.engine_spec import ENGINES

    own = {"agent_r1/engine_spec.py", "agent_r1/train/config.py", "agent_r1/rollout/server_api.py"}
    bad = []
    for p in PKG.rglob("*.py"):
        rel = str(p.relative_to(ROOT))
        if rel in own or rel.startswith(("agent_r1/engines/", "agent_r1/weights/vllm")):
            continue
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.Constant) and n.value in ENGINES and n.value != "embedded":
                bad.append(f"{rel}:{n.lineno}: {n.value!r}")
    assert not bad, "\n".join(bad)
