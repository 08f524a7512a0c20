"""Staleness figures of a testbed grid's finished runs, per seed and over seeds.

    python experiments/toy/testbed_staleness.py --config experiments/toy/testbed_sessions.yaml \
        --config experiments/toy/testbed_staleness.yaml --only grpo_roc,k2_tis,k2_areal [overrides]

Takes the grid's settings exactly as ``experiments/toy/testbed.py`` does and prints
`rstar2_jax.toy.staleness.staleness_table`: held-out avg pass@1, the collapse step (training
reward below 0.1 for good), the error ratio among positives over the last 5 steps, the largest
``logprob_mismatch/ratio_max`` and the RL wall time; nothing is run.
"""
from rstar2_jax.toy.staleness import staleness_table
from rstar2_jax.toy.testbed import parse_grid

if __name__ == "__main__":
    print(staleness_table(parse_grid(description=__doc__)[0]), end="")
