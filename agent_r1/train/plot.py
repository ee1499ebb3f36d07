"""Reward / success curves from a run's TensorBoard event files, drawn to a PNG."""

from __future__ import annotations

from pathlib import Path

CURVES = [
    ("eval/success", "held-out success (greedy)"),
    ("rollout/success", "rollout success (sampled)"),
    ("rollout/reward", "rollout reward"),
]


def read_scalars(logdir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of the event files under ``logdir``: tag -> [(step, value)] by step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    out = {}
    for tag in acc.Tags()["scalars"]:
        by_step = {e.step: e.value for e in acc.Scalars(tag)}  # a resumed run rewrote some steps
        out[tag] = sorted(by_step.items())
    return out


def plot_run(logdir: str | Path, out: str | Path, title: str | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = read_scalars(logdir)
    fig, ax = plt.subplots(figsize=(7, 4))
    for tag, label in CURVES:
        if data.get(tag):
            xs, ys = zip(*data[tag], strict=True)
            ax.plot(xs, ys, marker="o" if tag.startswith("eval") else None, ms=3, label=label)
    ax.set_xlabel("iteration")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title or Path(logdir).parent.name)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
