"""`agent-r1 view` in headless Chromium (Debian's package, driven by Playwright): a trained run's
page shows exactly the trajectories its records hold, a click into a step shows that step's action
token by token, the filters count what the records say, and nothing on the page fails."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agent_r1.agent.chat import ChatCodec
from agent_r1.records.reader import RecordStore

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

pytestmark = pytest.mark.skipif(
    shutil.which("chromium") is None, reason="Debian's chromium not installed (make install adds it)"
)


def _trajectories(run: Path) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for folder in (run / "records", run / "eval_records"):
        store = RecordStore(folder)
        for it in store.iterations():
            for r in store.read(it).to_pylist():
                out.setdefault(r["trajectory_id"], []).append(r)
    return out


def test_view_a_run_in_chromium(tiny_model_dir, finished_run, tmp_path):
    pytest.importorskip("playwright")
    from playwright.sync_api import sync_playwright
    from screenshot_view import chromium, screenshot

    run = finished_run
    page_file = tmp_path / "view.html"
    r = subprocess.run(
        [sys.executable, "-m", "agent_r1.cli", "view", str(run), "--out", str(page_file)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    trajs = _trajectories(run)
    assert f"{len(trajs)} of {len(trajs)} trajectories" in r.stdout
    text = page_file.read_text()
    assert "http://" not in text.split('<script id="data"')[0] and "<link" not in text  # self-contained
    codec = ChatCodec.load(str(tiny_model_dir))
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        page = browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(page_file.as_uri())
        assert page.locator(".traj").count() == len(trajs) == int(page.inner_text("#shown-count"))
        first = page.locator(".traj").first
        tid = first.get_attribute("data-id")
        first.locator(".sum").click()
        first.locator(".step .sh").first.click()
        step0 = min(trajs[tid], key=lambda s: s["step_index"])
        want = "".join(codec.decode([t]) for t in step0["action_token_ids"])
        assert first.locator("pre.action").inner_text() == want
        assert first.locator("pre.action span").count() == len(step0["action_token_ids"])
        # filters: truncated trajectories, then failures, as the records count them
        truncated = sum(
            1 for steps in trajs.values() if max(steps, key=lambda s: s["step_index"])["truncated"]
        )
        page.check("#f-trunc")
        assert int(page.inner_text("#shown-count")) == truncated
        page.uncheck("#f-trunc")
        page.select_option("#f-success", "yes")
        wins = sum(
            1 for steps in trajs.values()
            if (json.loads(max(steps, key=lambda s: s["step_index"])["info"]).get("reward") or {}).get("correct")
        )  # fmt: skip
        assert int(page.inner_text("#shown-count")) == wins
        assert not errors, errors
        browser.close()
    screenshot(page_file, tmp_path / "shot.png")
    assert (tmp_path / "shot.png").stat().st_size > 10_000


def test_view_refuses_a_folder_that_is_not_a_run(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "agent_r1.cli", "view", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        r.returncode != 0
        and "not a run directory (no config.yaml)" in r.stderr
        and "Traceback" not in r.stderr
    )
