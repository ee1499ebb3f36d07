#!/usr/bin/env python
"""Draw a run's reward / success curves from its TensorBoard event files.

python tools/plot_run.py runs/quickstart            # -> runs/quickstart/curve.png
python tools/plot_run.py runs/quickstart --out docs/quickstart_curve.png
"""

from __future__ import annotations

import argparse
from pathlib import Path

from agent_r1.train.plot import plot_run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", help="a run directory (with tensorboard/) or an event-file folder")
    ap.add_argument("--out", help="PNG path (default RUN_DIR/curve.png)")
    ap.add_argument("--title")
    a = ap.parse_args()
    run = Path(a.run_dir)
    logdir = run / "tensorboard" if (run / "tensorboard").is_dir() else run
    print(plot_run(logdir, a.out or run / "curve.png", a.title))


if __name__ == "__main__":
    main()
