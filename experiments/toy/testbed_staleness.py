"""Staleness figures of a testbed grid's finished runs, per seed and over seeds.

    python experiments/toy/testbed_staleness.py --config experiments/toy/testbed_sessions.yaml \
        --config experiments/toy/testbed_staleness.yaml --only grpo_roc,k2_tis,k2_areal [overrides]

Takes the grid's settings exactly as ``experiments/toy/testbed.py`` does and prints
`rstar2_jax.toy.staleness.staleness_table`: held-out avg pass@1, the collapse step (training
reward below 0.1 for good), the error ratio among positives over the last 5 steps, the largest
``logprob_mismatch/ratio_max`` and the RL wall time; nothing is run.
"""
import argparse
import dataclasses

from rstar2_jax.config import load_config
from rstar2_jax.toy.staleness import staleness_table
from rstar2_jax.toy.testbed import TestbedConfig

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="comma-separated arm names")
    parser.add_argument("--config", action="append",
                        help="YAML file of TestbedConfig settings, as for testbed.py (several: in order)")
    parser.add_argument("overrides", nargs="*", help="key=value settings of TestbedConfig, as for testbed.py")
    args = parser.parse_intermixed_args()
    cfg = load_config(TestbedConfig, args.config, args.overrides)
    if args.only:
        cfg = dataclasses.replace(cfg, arms={name: cfg.arms[name] for name in args.only.split(",")})
    print(staleness_table(cfg), end="")
