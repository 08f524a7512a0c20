"""Per-arm training metrics and held-out gain of a finished testbed grid, over seeds.

    python experiments/toy/testbed_metrics.py [--only a,b] [--metrics m1,m2] [--config FILE] [testbed overrides]

Takes the grid's settings exactly as ``experiments/toy/testbed.py`` does (the same config file
and overrides name the same result files) and prints `rstar2_jax.toy.testbed.metrics_table`: per
arm, the held-out avg pass@1 after RL minus after SFT of the same seed, and each metric averaged
over the RL steps of a run; every cell mean [min, max] over seeds. The default metrics are the
sampler/trainer gap and the rollout correction's statistics (docs/algorithms.md).
"""
import argparse
import dataclasses

from rstar2_jax.config import load_config
from rstar2_jax.toy.testbed import TestbedConfig, metrics_table

DEFAULT_METRICS = ("logprob_mismatch/abs", "logprob_mismatch/kl", "logprob_mismatch/log_ppl_abs_diff",
                   "logprob_mismatch/ratio_max", "logprob_mismatch/ratio_min",
                   "rollout_correction/weight_mean", "rollout_correction/truncated_frac")

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="comma-separated arm names")
    parser.add_argument("--metrics", default=",".join(DEFAULT_METRICS), help="comma-separated metric names")
    parser.add_argument("--config", action="append",
                        help="YAML file of TestbedConfig settings, as for testbed.py (several: in order)")
    parser.add_argument("overrides", nargs="*", help="key=value settings of TestbedConfig, as for testbed.py")
    args = parser.parse_args()
    cfg = load_config(TestbedConfig, args.config, args.overrides)
    if args.only:
        cfg = dataclasses.replace(cfg, arms={name: cfg.arms[name] for name in args.only.split(",")})
    print(metrics_table(cfg, args.metrics.split(",")), end="")
