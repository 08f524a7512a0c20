"""The testbed grid: RL algorithms over seeds on the toy, each arm from the same SFT policy per seed.

    python experiments/toy/testbed.py                              # 3 arms x 3 seeds, runs/testbed
    python experiments/toy/testbed.py out=runs/small seeds=[0] demo.rl_steps=10
    python experiments/toy/testbed.py arms.dr_grpo.algorithm=dr_grpo          # add an arm
    python experiments/toy/testbed.py arms.mine.algorithm=my_module:MINE arms.mine.oversample=1

Any field of ``rstar2_jax.toy.testbed.TestbedConfig`` (``demo.*``: the main job's settings).
Re-running with the same ``out`` reads finished runs back and runs only what is missing, then
rewrites ``summary.md``, ``summary.json`` and the plots. docs/testbed.md has the details.
"""
import sys

from rstar2_jax.config import load_config
from rstar2_jax.toy.testbed import TestbedConfig, run_testbed

if __name__ == "__main__":
    cfg = load_config(TestbedConfig, overrides=sys.argv[1:])
    run_testbed(cfg)
    print(open(f"{cfg.out}/summary.md").read())
