"""Training curves as PNG files, drawn from the per-step metrics JSONL of one or more RL runs.

    runs = {"GRPO-RoC": read_metrics("runs/roc"), "GRPO": read_metrics("runs/grpo")}
    plot_curves(runs, "curves.png")                       # the four panels of RL_PANELS
    plot_curves(runs, "err.png", panels=RL_PANELS[1:2])   # one panel

Each panel draws every run's raw per-step values as a faint line and a trailing moving average
over them, since a toy step scores few questions and its statistics are noisy.
"""
from __future__ import annotations

import os
from typing import Mapping, Sequence

import numpy as np
# A bare Figure draws to files without pyplot, so neither needs a display nor changes the backend
# of a notebook that imports this module.
from matplotlib.figure import Figure

# (metric key written by the RL loop, panel title): the curves of paper Fig. 4 and §4.3.
RL_PANELS: tuple[tuple[str, str], ...] = (
    ("reward/mean", "training reward (accuracy of sampled rollouts)"),
    ("tools/error_ratio_positives", "tool-call error ratio among positive rollouts"),
    ("response/length_mean", "response length (tokens)"),
    ("tools/calls_per_rollout", "tool calls per rollout"),
)


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over the last ``window`` values (fewer at the start); same length as ``values``."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    sums = np.cumsum(np.insert(np.asarray(values, np.float64), 0, 0.0))
    ends = np.arange(1, len(values) + 1)
    starts = np.maximum(ends - window, 0)
    return (sums[ends] - sums[starts]) / (ends - starts)


def plot_curves(runs: Mapping[str, Sequence[dict]], path: str | os.PathLike,
                panels: Sequence[tuple[str, str]] = RL_PANELS, window: int = 5) -> None:
    """Writes one PNG with a panel per ``(metric, title)``, one line per run, x = step.

    Args:
      runs: run label -> metric records (``{"step": s, metric: value, ...}`` as logged by
        ``MetricsLogger``); records without a metric are skipped in its panel.
      path: the PNG file to write.
      window: steps in the moving average.

    Raises ValueError if a panel's metric appears in no run (most likely a misspelled key).
    """
    if not runs or not panels:
        raise ValueError("need at least one run and one panel")
    columns = min(2, len(panels))
    rows = -(-len(panels) // columns)
    fig = Figure(figsize=(6 * columns, 3.6 * rows))
    axes = fig.subplots(rows, columns, squeeze=False)
    for ax, (key, title) in zip(axes.flat, panels):
        if not any(key in r for records in runs.values() for r in records):
            raise ValueError(f"no run logged the metric {key!r}")
        for i, (label, records) in enumerate(runs.items()):
            points = [(r["step"], r[key]) for r in records if key in r]
            if not points:
                continue
            steps, values = map(np.asarray, zip(*points))
            color = f"C{i}"
            ax.plot(steps, values, color=color, alpha=0.25, linewidth=1)
            ax.plot(steps, moving_average(values, window), color=color, linewidth=2, label=label)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
