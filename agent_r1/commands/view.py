"""``agent-r1 view``: a run's trajectories as one self-contained HTML file."""

from __future__ import annotations

import argparse

from agent_r1.logging import setup_logging


def add_parser(sub: argparse._SubParsersAction) -> None:
    vw = sub.add_parser("view", help="a run's trajectories as one self-contained HTML file")
    vw.add_argument("run_dir")
    vw.add_argument("--out", default=None, help="default: RUN_DIR/view.html")
    vw.add_argument(
        "--groups-per-iteration",
        type=int,
        default=8,
        help="groups shown per iteration (chosen evenly, seeded)",
    )
    vw.add_argument("--strict", action="store_true", help="a damaged iteration is an error (default: marked)")
    vw.set_defaults(fn=run)


def run(a: argparse.Namespace) -> int:
    from agent_r1.viewer import write_view

    setup_logging("view")
    out, d = write_view(a.run_dir, a.out, a.groups_per_iteration, a.strict)
    print(
        f"{out}: {d['shown_trajectories']} of {d['total_trajectories']} trajectories, "
        f"{d['file_bytes'] / 1e6:.2f} MB; open it in a browser (no server needed)",
        flush=True,
    )
    return 0
