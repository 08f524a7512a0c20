"""The staleness table of a testbed grid: the collapse step by its rule, and the per-seed and
over-seed figures of made-up finished runs (result files as the testbed writes them)."""
import json

from rstar2_jax.toy import testbed
from rstar2_jax.toy.staleness import collapse_step, staleness_table
from rstar2_jax.toy.testbed import Arm, result_path


def test_collapse_is_a_low_reward_to_the_end_for_three_steps_or_more():
    assert collapse_step([0.5, 0.09, 0.05, 0.2, 0.0, 0.004, 0.0, 0.0]) == 5
    # A dip of three low steps that recovers is no collapse.
    assert collapse_step([0.5, 0.07, 0.08, 0.06, 0.15, 0.3]) is None
    assert collapse_step([0.5, 0.3, 0.05, 0.0]) is None  # two low steps at the end: too few
    assert collapse_step([0.05, 0.0, 0.0]) == 1
    assert collapse_step([0.5, 0.1, 0.1, 0.1]) is None  # 0.1 is not below 0.1
    assert collapse_step([0.5, 0.0, None, 0.0, 0.0]) is None  # a step without a reward is not low
    assert collapse_step([]) is None


def _write(cfg, arm, seed, pass1, rewards, ratios, minutes):
    steps = [{"reward/mean": r, "logprob_mismatch/ratio_max": q, testbed.ERROR_RATIO: 0.2 if r > 0.1 else None}
             for r, q in zip(rewards, ratios)]
    path = result_path(cfg.out, arm, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"arm": arm, "seed": seed, "settings": testbed._run_settings(cfg, arm, seed),
                                "eval": {"pass_at": {"1": pass1}}, "seconds": {"train": 60 * minutes},
                                "metrics": testbed.with_missing(steps)}))


def test_the_table_gives_each_seed_and_the_spread(tmp_path):
    cfg = testbed.TestbedConfig(out=str(tmp_path), seeds=[0, 1, 2],
                                arms={"k2": Arm(max_staleness=2, label="k = 2"), "k4": Arm(max_staleness=4)})
    _write(cfg, "k2", 0, 0.5, [0.4, 0.6, 0.7, 0.8, 0.7, 0.9], [1.0, 3.0, 9.5, 2.0, 1.0, 1.5], 10.0)
    _write(cfg, "k2", 2, 0.0, [0.4, 0.3, 0.05, 0.0, 0.0, 0.0], [1.0, 40.0, 300.0, 1.0, 1.0, 1.0], 21.5)
    lines = staleness_table(cfg).splitlines()
    assert len(lines) == 3  # k4 has no finished run: no row
    cells = [c.strip() for c in lines[2].split("|")[1:-1]]
    assert cells == ["k = 2", "2", "50.0% / - / 0.0%", "25% [0, 50]", "none / - / 3",
                     "20% [20, 20]", "9.5 (3) / - / 300 (3)", "155 [9.5, 300]", "10.0 / - / 21.5"]
