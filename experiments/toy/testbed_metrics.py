"""Per-arm training metrics and held-out gain of a finished testbed grid, over seeds.

    python experiments/toy/testbed_metrics.py [--only a,b] [--metrics m1,m2] [--config FILE] [testbed overrides]

Takes the grid's settings exactly as ``experiments/toy/testbed.py`` does (the same config file
and overrides name the same result files) and prints `rstar2_jax.toy.testbed.metrics_table`: per
arm, the held-out avg pass@1 after RL minus after SFT of the same seed, and each metric averaged
over the RL steps of a run; every cell mean [min, max] over seeds. The default metrics are the
sampler/trainer gap and the rollout correction's statistics (docs/algorithms.md).
"""
from rstar2_jax.toy.testbed import metrics_table, parse_grid

DEFAULT_METRICS = ("logprob_mismatch/abs", "logprob_mismatch/kl", "logprob_mismatch/log_ppl_abs_diff",
                   "logprob_mismatch/ratio_max", "logprob_mismatch/ratio_min",
                   "rollout_correction/weight_mean", "rollout_correction/truncated_frac")

if __name__ == "__main__":
    cfg, args = parse_grid(description=__doc__, options=lambda parser: parser.add_argument(
        "--metrics", default=",".join(DEFAULT_METRICS), help="comma-separated metric names"))
    print(metrics_table(cfg, args.metrics.split(",")), end="")
