"""The testbed grid: RL algorithms over seeds on the toy, each arm from the same SFT policy per seed.

    python experiments/toy/testbed.py                              # 3 arms x 3 seeds, runs/testbed
    python experiments/toy/testbed.py out=runs/small seeds=[0] demo.stage.steps=10
    python experiments/toy/testbed.py --only grpo_2g out=runs/tb   # these arms only, for now
    python experiments/toy/testbed.py arms.dr_grpo.algorithm=dr_grpo          # add an arm
    python experiments/toy/testbed.py arms.mine.algorithm=my_module:MINE arms.mine.oversample=1
    python experiments/toy/testbed.py --config experiments/toy/testbed_sessions.yaml  # session environment
    python experiments/toy/testbed.py --config experiments/toy/testbed_staleness.yaml --only k0,k1   # async RL

``--config FILE``: a YAML file of settings, applied before the overrides; given several times,
the files apply in order (``--config testbed_sessions.yaml --config testbed_staleness.yaml``:
the staleness arms on the session environment, a later file's values winning). Any field of
``rstar2_jax.toy.testbed.TestbedConfig`` (``demo.*``: the main job's settings).
``--only a,b`` runs and summarises only those arms; their results are the full grid's, which a
later run without ``--only`` reads back. Re-running with the same ``out`` reads finished runs
back and runs only what is missing, then rewrites ``summary.md``, ``summary.json`` and the
plots. docs/testbed.md has the details.
"""
from rstar2_jax.compile_cache import enable_persistent_cache
from rstar2_jax.toy.testbed import TestbedConfig, parse_grid, run_testbed


def parse(argv: list[str] | None = None) -> TestbedConfig:
    """The grid the command line asks for; options and overrides may come in any order."""
    return parse_grid(argv, description=__doc__)[0]


if __name__ == "__main__":
    cfg = parse()
    # As every `python -m rstar2_jax` job: each RL run builds its own jitted steps, so without
    # the persistent cache every arm and seed compiles the same programs again (on a loaded
    # 2-core machine ~35 s for each new packed row count, most of a run's early steps).
    enable_persistent_cache()
    run_testbed(cfg)
    print(open(f"{cfg.out}/summary.md").read())
