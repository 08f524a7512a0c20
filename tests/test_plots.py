"""Training curves: missing values (absent or NaN) are skipped, never drawn as 0."""
import math

import numpy as np
import pytest

from rstar2_jax.plots import RL_PANELS, moving_average, plot_curves, series

KEY = "tools/error_ratio_positives"


def test_series_skips_absent_and_nan_steps():
    records = [{"step": 1, KEY: 0.5}, {"step": 2}, {"step": 3, KEY: math.nan}, {"step": 4, KEY: 0.25}]
    steps, values = series(records, KEY)
    np.testing.assert_array_equal(steps, [1, 4])
    np.testing.assert_array_equal(values, [0.5, 0.25])
    steps, values = series([{"step": 1}], KEY)
    assert steps.size == values.size == 0


def test_moving_average_is_trailing():
    np.testing.assert_allclose(moving_average(np.array([1.0, 3.0, 5.0, 7.0]), 2), [1, 2, 4, 6])
    with pytest.raises(ValueError):
        moving_average(np.ones(3), 0)


def test_curves_with_gaps_and_a_metric_no_step_measured(tmp_path):
    full = [{"step": s, "reward/mean": 0.1 * s, "response/length_mean": 50.0,
             "tools/calls_per_rollout": 1.0} | ({KEY: 0.2} if s % 2 else {}) for s in range(1, 8)]
    never = [{k: v for k, v in r.items() if k != KEY} for r in full]
    plot_curves({"a": full, "b": never}, tmp_path / "gaps.png")
    plot_curves({"b": never}, tmp_path / "none.png", panels=RL_PANELS[1:2])
    for name in ("gaps.png", "none.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
