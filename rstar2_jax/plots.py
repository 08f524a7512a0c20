"""Training curves as PNG files, drawn from the per-step metrics JSONL of one or more RL runs.

    runs = {"GRPO-RoC": read_metrics("runs/roc"), "GRPO": read_metrics("runs/grpo")}
    plot_curves(runs, "curves.png")                       # the four panels of RL_PANELS
    plot_curves(runs, "err.png", panels=RL_PANELS[1:2])   # one panel
    plot_bands({"GRPO-RoC": [seed0, seed1, seed2]}, "bands.png")  # mean and min-max over seeds

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


def mean_band(runs: Sequence[Sequence[dict]], key: str, window: int = 5,
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(steps, mean, low, high)`` of one metric over several runs (seeds): each run's trailing
    moving average over the steps that have the metric (`series`), then, at every step where at
    least one run has a value, the mean, min and max over those runs."""
    smoothed = []
    for records in runs:
        steps, values = series(records, key)
        smoothed.append(dict(zip(steps.tolist(), moving_average(values, window).tolist())))
    steps = np.array(sorted(set().union(*smoothed)), dtype=np.int64)
    if not len(steps):
        return steps, np.zeros(0), np.zeros(0), np.zeros(0)
    grid = np.array([[run.get(s, np.nan) for s in steps] for run in smoothed])
    # Every column has at least one value, so these reductions never see an all-NaN column.
    return steps, np.nanmean(grid, axis=0), np.nanmin(grid, axis=0), np.nanmax(grid, axis=0)


def _draw_panels(path, panels: Sequence[tuple[str, str]], draw) -> None:
    """A PNG with one panel per ``(metric, title)``; ``draw(ax, key)`` draws a panel's lines and
    returns whether it drew any (if not, the panel says that no step measured the metric)."""
    if not panels:
        raise ValueError("need at least one panel")
    columns = min(2, len(panels))
    rows = -(-len(panels) // columns)
    fig = Figure(figsize=(6 * columns, 3.6 * rows))
    axes = fig.subplots(rows, columns, squeeze=False)
    for ax, (key, title) in zip(axes.flat, panels):
        if draw(ax, key):
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
    if not runs:
        raise ValueError("need at least one run")

    def draw(ax, key):
        drawn = False
        for i, (label, records) in enumerate(runs.items()):
            steps, values = series(records, key)
            if len(steps):
                ax.plot(steps, values, color=f"C{i}", alpha=0.25, linewidth=1)
                ax.plot(steps, moving_average(values, window), color=f"C{i}", linewidth=2, label=label)
                drawn = True
        return drawn

    _draw_panels(path, panels, draw)


def plot_bands(arms: Mapping[str, Sequence[Sequence[dict]]], path: str | os.PathLike,
               panels: Sequence[tuple[str, str]] = RL_PANELS, window: int = 5) -> None:
    """Like `plot_curves`, for several runs (seeds) per label: each label's mean curve
    (`mean_band`) and a shaded band from the min to the max over its runs."""
    if not arms or not all(arms.values()):
        raise ValueError("need at least one label, each with at least one run")

    def draw(ax, key):
        drawn = False
        for i, (label, runs) in enumerate(arms.items()):
            steps, mean, low, high = mean_band(runs, key, window)
            if len(steps):
                ax.fill_between(steps, low, high, color=f"C{i}", alpha=0.2, linewidth=0)
                ax.plot(steps, mean, color=f"C{i}", linewidth=2, label=f"{label} ({len(runs)} runs)")
                drawn = True
        return drawn

    _draw_panels(path, panels, draw)
