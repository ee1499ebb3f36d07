"""Open an ``agent-r1 view`` page in headless Chromium (Debian's), expand a trajectory and a step,
and save a screenshot: ``python tools/screenshot_view.py RUN_DIR/view.html docs/viewer.png``."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    raise SystemExit("no Chromium found (make install adds Debian's chromium)")


def screenshot(
    page_file: str | Path, out: str | Path, width: int = 1400, height: int = 1500, open_first: bool = True
) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": width, "height": height})
        page.goto(Path(page_file).resolve().as_uri())
        if open_first:
            page.locator(".traj .sum").first.click()
            page.locator(".step .sh").first.click()
        page.screenshot(path=str(out))
        browser.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("page")
    ap.add_argument("out")
    ap.add_argument("--width", type=int, default=1400)
    ap.add_argument("--height", type=int, default=1500)
    a = ap.parse_args()
    screenshot(a.page, a.out, a.width, a.height)
    print(a.out)
