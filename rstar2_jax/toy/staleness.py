"""What staleness did to a testbed grid's runs: held-out accuracy, the collapse step, the largest
sampler/trainer ratio and the wall time, per seed and mean [min, max] over seeds.

``experiments/toy/testbed_staleness.py`` prints `staleness_table` for the arms it is given; the
runs are the testbed's result files (`rstar2_jax.toy.testbed`), read back, never run.
"""
from __future__ import annotations

from typing import Sequence

from rstar2_jax.toy.testbed import ERROR_RATIO, TestbedConfig, load_results, spread, window_mean

# A run has collapsed when its training reward (accuracy of the sampled rollouts) falls below
# this for good, for at least COLLAPSE_RUN steps: with no correct rollout in a group there is
# no advantage and no update, so such a policy does not recover (docs/testbed.md, "Staleness").
# A dip that recovers is no collapse.
COLLAPSE_REWARD = 0.1
COLLAPSE_RUN = 3


def collapse_step(rewards: Sequence[float | None]) -> int | None:
    """The 1-based step from which the training reward stays below `COLLAPSE_REWARD` to the end
    of the run, when that is at least `COLLAPSE_RUN` steps; None otherwise. A step without a
    reward (null) counts as not low."""
    start = len(rewards)
    while start > 0 and rewards[start - 1] is not None and rewards[start - 1] < COLLAPSE_REWARD:
        start -= 1
    return start + 1 if len(rewards) - start >= COLLAPSE_RUN else None


def run_row(run: dict) -> dict:
    """One finished run's figures: held-out avg pass@1, the error ratio among positives over its
    last 5 steps, its collapse step, its largest ``logprob_mismatch/ratio_max`` and the step of
    it, and its RL wall time in minutes (``seconds.train``: of the last start when resumed)."""
    steps = run["metrics"]
    ratios = [(r.get("logprob_mismatch/ratio_max"), i + 1) for i, r in enumerate(steps)]
    peak, peak_step = max((r, s) for r, s in ratios if r is not None) if steps else (None, None)
    return {"pass1": run["eval"]["pass_at"]["1"], "error_ratio_last": window_mean(steps, ERROR_RATIO, last=5),
            "collapse": collapse_step([r.get("reward/mean") for r in steps]),
            "ratio_max": peak, "ratio_max_step": peak_step, "minutes": run["seconds"]["train"] / 60}


def staleness_table(cfg: TestbedConfig) -> str:
    """A markdown table of ``cfg``'s finished runs: per arm, each seed's held-out pass@1,
    collapse step and largest ratio; the mean [min, max] over seeds of pass@1, of the error
    ratio among positives over the last 5 steps and of the largest ratio; RL minutes per seed."""
    results = load_results(cfg)
    lines = ["| arm | seeds | held-out pass@1 per seed | mean [min, max] | collapse step per seed | "
             "err. ratio among positives, last 5 steps | largest ratio_max per seed (step) | "
             "mean [min, max] | RL minutes per seed |", "|---" * 9 + "|"]
    for name in cfg.arms:
        rows = {r["seed"]: run_row(r) for r in results[name]}
        if not rows:
            continue
        per_seed = [rows.get(s) for s in cfg.seeds]
        pass1 = spread([r["pass1"] for r in rows.values()])
        errors = spread([r["error_ratio_last"] for r in rows.values()])
        peaks = spread([r["ratio_max"] for r in rows.values()])
        cells = [
            " / ".join("-" if r is None else f"{100 * r['pass1']:.1f}%" for r in per_seed),
            _spread_cell(pass1, 100, "%"),
            " / ".join("-" if r is None else str(r["collapse"] or "none") for r in per_seed),
            _spread_cell(errors, 100, "%") if errors["seeds"] else "missing",
            " / ".join("-" if r is None else f"{r['ratio_max']:.3g} ({r['ratio_max_step']})" for r in per_seed),
            _spread_cell(peaks, 1, ""),
            " / ".join("-" if r is None else f"{r['minutes']:.1f}" for r in per_seed)]
        lines.append(f"| {cfg.label(name)} | {len(rows)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _spread_cell(s: dict, scale: float, unit: str) -> str:
    return f"{scale * s['mean']:.3g}{unit} [{scale * s['min']:.3g}, {scale * s['max']:.3g}]"
