"""The sandbox under the ``python`` tool: each abuse is stopped within its limit with an error
that names it, nothing it started survives, and the next run works (the worker keeps running)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import psutil
import pytest
from eventually import eventually

from agent_r1.agent_tools import TOOLS
from agent_r1.agent_tools.sandbox import Limits, Sandbox, isolation

LIMITS = Limits(wall_s=4, cpu_s=2, memory_mb=1024, file_mb=4, processes=8, output_chars=300)


def run(code: str, sandbox: Sandbox | None = None, **files):
    sb = sandbox or Sandbox(LIMITS)
    t0 = time.monotonic()
    r = asyncio.run(sb.run(code, files))
    return r, time.monotonic() - t0


def sandbox_processes() -> list[psutil.Process]:
    """Processes of the sandbox users still alive (zombies about to be reaped aside)."""
    out = []
    for p in psutil.process_iter(["uids", "status"]):
        try:
            if p.info["uids"].real >= 61000 and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            pass
    return out


def test_code_runs_with_pandas_in_its_own_folder_and_a_table():
    r, _ = run(
        "import pandas as pd, os\ndf = pd.read_csv('t.csv')\nprint(df.b.sum(), os.listdir('.'))",
        **{"t.csv": "a,b\nx,1\ny,41\n"},
    )
    assert r.error is None and r.stdout.startswith("42 ") and "t.csv" in r.stdout


ABUSES = {
    "syntax": ("print(", "SyntaxError"),
    "exception": ("print('before'); 1/0", "ZeroDivisionError: division by zero"),
    "infinite loop": ("while True: pass", "CPU time limit (2 s) exceeded"),
    "sleeping": ("import time; time.sleep(100)", "wall time limit (4 s) exceeded"),
    "memory hog": ("x = bytearray(4 << 30)", "over the memory limit (1024 MB)"),
    "fork bomb": ("import os\nwhile True:\n    os.fork()", "the process limit is 8"),
    "huge output": (
        "import sys\nfor _ in range(100): sys.stdout.write('x' * 10**6)",
        "file size limit (4 MB)",
    ),
}


@pytest.mark.parametrize("name", sorted(ABUSES))
def test_each_abuse_is_stopped_within_its_limit_and_named(name):
    if name == "fork bomb" and not isolation()["own_user"]:  # the process limit needs a user of its own
        pytest.skip("the process limit needs a sandbox user of its own (root) here")
    code, says = ABUSES[name]
    r, took = run(code)
    assert r.error is not None and says in r.error, r
    assert took < 4 * LIMITS.wall_s + 10  # stopped by its limit (named above), never left to run on
    if name == "exception":
        assert r.stdout == "before\n"
    assert eventually(sandbox_processes, lambda left: left == []) == []  # reaped, however busy


def test_output_is_cut_to_its_budget():
    r, _ = run("print('y' * 5000)")
    assert r.error is None and r.stdout.startswith("y" * 300) and "[output cut to 300 characters]" in r.stdout
    assert len(r.stdout) < 400


needs_root = pytest.mark.skipif(not isolation()["namespaces"], reason="namespaces and users need root here")


@needs_root
def test_no_writes_outside_the_scratch_folder_and_a_private_tmp(tmp_path):
    # /etc: a root-owned folder outside /tmp (a checkout under /tmp is hidden by the private tmpfs)
    target = Path("/etc") / "agent-r1-sandbox-escape"
    r, _ = run(f"open({str(target)!r}, 'w').write('x')")
    assert "PermissionError" in r.error and not target.exists()
    r, _ = run(
        "open('/tmp/agent-r1-sandbox-probe', 'w').write('x'); print(open('/tmp/agent-r1-sandbox-probe').read())"
    )
    assert r.error is None and r.stdout == "x\n" and not os.path.exists("/tmp/agent-r1-sandbox-probe")


@needs_root
def test_no_network_not_even_loopback():
    import socket

    with socket.socket() as srv:  # a live port on this machine's loopback
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        r, _ = run(f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)")
    assert "Network is unreachable" in r.error


@needs_root
def test_a_process_that_leaves_the_group_dies_with_the_run():
    r, _ = run("import os, time\nif os.fork() == 0:\n    os.setsid(); time.sleep(300)\ntime.sleep(300)")
    assert "wall time limit" in r.error
    assert eventually(sandbox_processes, lambda left: left == []) == []  # reaped, however busy


def test_many_runs_at_once_from_a_bounded_pool():
    sb = Sandbox(LIMITS, pool=3)

    async def main():
        return await asyncio.gather(
            *(sb.run(f"import time; time.sleep(0.3); print({i} * 2)") for i in range(9))
        )

    t0 = time.monotonic()
    out = asyncio.run(main())
    assert [r.stdout for r in out] == [f"{i * 2}\n" for i in range(9)] and all(r.error is None for r in out)
    assert time.monotonic() - t0 >= 0.9  # three waves of three


def test_the_python_tool_answers_every_failure_as_an_error_observation():
    from agent_r1.agent_tools.base import ToolError

    tool = TOOLS.get("python")(wall_s=4, cpu_s=2, files={"t.csv": "a\n1\n2\n"})
    out = asyncio.run(tool.execute({"code": "import pandas as pd; print(pd.read_csv('t.csv').a.sum())"}))
    assert out.result == "3"
    with pytest.raises(ToolError, match=r"ZeroDivisionError.*\n\(printed before it: hi\)"):
        asyncio.run(tool.execute({"code": "print('hi'); 1/0"}))
    with pytest.raises(ValueError, match="no option 'wall'"):
        TOOLS.get("python")(wall=3)
    assert tool.timeout_s > 4  # the sandbox's own wall limit fires before the env's tool timeout
