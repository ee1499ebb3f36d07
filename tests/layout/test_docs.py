"""The docs resolve: every relative link and anchor of README.md, docs/ and the recipe READMEs
points at a file and heading that exist, and every ``agent-r1`` command, its flags, ``make`` target
and ``python tools/...`` script they show exists."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted(
    [
        ROOT / "README.md",
        *(ROOT / "docs").glob("*.md"),
        *(ROOT / "recipes").glob("*/README.md"),
        ROOT / "configs" / "README.md",
    ]  # fmt: skip
)
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE = re.compile(r"```.*?```|`[^`\n]+`", re.S)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {slug(m) for m in re.findall(r"^#{1,6} (.*)$", text, flags=re.M)}


def link_problems(path: Path) -> list[str]:
    out = []
    for target in LINK.findall(re.sub(r"```.*?```", "", path.read_text(), flags=re.S)):
        if re.match(r"^[a-z]+:", target):
            continue
        file, _, frag = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            out.append(f"{path.relative_to(ROOT)}: {target}: no such file")
        elif frag and dest.suffix == ".md" and frag not in anchors(dest):
            out.append(f"{path.relative_to(ROOT)}: {target}: no heading #{frag} in {dest.relative_to(ROOT)}")
    return out


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            return dict(a.choices)
    return {}


def command_problems(path: Path, parser: argparse.ArgumentParser, targets: set[str]) -> list[str]:
    out, where = [], path.relative_to(ROOT)
    for span in CODE.findall(path.read_text()):
        for line in span.splitlines():
            for m in re.finditer(r"\bagent-r1 ((?:[a-z][\w-]*\s?)+)(.*)", line):
                words, p = m.group(1).split(), parser
                subs = _subparsers(p)
                if not words or words[0] not in subs:
                    out.append(f"{where}: `agent-r1 {m.group(1).strip()}`: no such command")
                    continue
                while words and words[0] in subs:
                    p = subs[words.pop(0)]
                    subs = _subparsers(p)
                known = {o for a in p._actions for o in a.option_strings}
                for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", m.group(0)):
                    if flag not in known:
                        out.append(f"{where}: `{m.group(0).strip()[:80]}`: {p.prog} has no {flag}")
            for t in re.findall(r"\bmake ([a-z][\w-]*)", line):
                if t not in targets:
                    out.append(f"{where}: `make {t}`: no such target in the Makefile")
            for script in re.findall(r"(?<![\w/.-])(tools/[\w/]+\.(?:py|sh))", line):
                if not (ROOT / script).exists():
                    out.append(f"{where}: {script}: no such script")
    return out


def test_the_readme_is_a_landing_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines (<= 300: the rest goes to docs/)"
    text = "\n".join(lines)
    assert text.index("make run") < text.index("## Adding a task") < len(text) // 2


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_and_commands_resolve(path):
    from agent_r1.cli import build_parser

    targets = set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), flags=re.M))
    problems = link_problems(path) + command_problems(path, build_parser(), targets)
    assert not problems, "\n".join(problems)


def test_the_checker_finds_a_broken_link_a_bad_command_and_a_bad_flag(tmp_path, monkeypatch):
    from agent_r1.cli import build_parser

    doc = ROOT / "docs" / "_checker_probe.md"
    doc.write_text(
        "# Probe\n[a](nope.md) [b](#probe) [c](#nowhere) [d](architecture.md#no-such-heading)\n"
        "`agent-r1 nosuch --x` `agent-r1 eval --run R --bogus 1` `agent-r1 records stats DIR --strict`"
        " `make nope` `python tools/nope.py`\n"
    )
    try:
        problems = link_problems(doc) + command_problems(doc, build_parser(), {"run", "test"})
    finally:
        doc.unlink()
    text = "\n".join(problems)
    assert "nope.md: no such file" in text and "#nowhere: no heading" in text
    assert "no heading #no-such-heading in docs/architecture.md" in text
    assert "`agent-r1 nosuch`: no such command" in text and "agent-r1 eval has no --bogus" in text
    assert "`make nope`" in text and "tools/nope.py: no such script" in text
    assert len(problems) == 7, text  # #probe and `records stats --strict` resolve
