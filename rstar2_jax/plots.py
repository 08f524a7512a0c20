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


def series(records: Sequence[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of one metric over a run's records, skipping the steps where it is missing:
    absent (a ratio with nothing to measure, e.g. the tool-error ratio among positives in a step
    without a positive) or NaN."""
    points = [(r["step"], float(r[key])) for r in records
              if key in r and r[key] is not None and np.isfinite(r[key])]
    steps, values = (np.asarray(x) for x in zip(*points)) if points else (np.zeros(0), np.zeros(0))
    return steps, values


def plot_curves(runs: Mapping[str, Sequence[dict]], path: str | os.PathLike,
                panels: Sequence[tuple[str, str]] = RL_PANELS, window: int = 5) -> None:
    """Writes one PNG with a panel per ``(metric, title)``, one line per run, x = step.

    Args:
      runs: run label -> metric records (``{"step": s, metric: value, ...}`` as logged by
        ``MetricsLogger``); a step where a metric is missing (`series`) is skipped in its panel,
        and the moving average runs over the steps that have it.
      path: the PNG file to write.
      window: steps in the moving average.

    A panel whose metric no run has for any step says so in place of its curves.
    """
    if not runs or not panels:
        raise ValueError("need at least one run and one panel")
    columns = min(2, len(panels))
    rows = -(-len(panels) // columns)
    fig = Figure(figsize=(6 * columns, 3.6 * rows))
    axes = fig.subplots(rows, columns, squeeze=False)
    for ax, (key, title) in zip(axes.flat, panels):
        drawn = False
        for i, (label, records) in enumerate(runs.items()):
            steps, values = series(records, key)
            if not len(steps):
                continue
            color = f"C{i}"
            ax.plot(steps, values, color=color, alpha=0.25, linewidth=1)
            ax.plot(steps, moving_average(values, window), color=color, linewidth=2, label=label)
            drawn = True
        if drawn:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, f"{key!r}: measured in no step", ha="center", va="center",
                    transform=ax.transAxes, fontsize=9)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
