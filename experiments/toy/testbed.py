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
import argparse
import dataclasses

from rstar2_jax.compile_cache import enable_persistent_cache
from rstar2_jax.config import load_config
from rstar2_jax.toy.testbed import TestbedConfig, run_testbed

def parse(argv: list[str] | None = None) -> TestbedConfig:
    """The grid the command line asks for; options and overrides may come in any order."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="comma-separated arm names to run and summarise")
    parser.add_argument("--config", action="append",
                        help="YAML file of TestbedConfig settings, applied before the overrides "
                             "(several: in order)")
    parser.add_argument("overrides", nargs="*", help="key=value settings of TestbedConfig")
    # Intermixed: `--only a,b out=X` gives the overrides after the option too.
    args = parser.parse_intermixed_args(argv)
    cfg = load_config(TestbedConfig, args.config, args.overrides)
    if args.only:
        names = args.only.split(",")
        unknown = sorted(set(names) - set(cfg.arms))
        if unknown:
            parser.error(f"--only names unknown arms {unknown}; the arms are {', '.join(cfg.arms)}")
        cfg = dataclasses.replace(cfg, arms={name: cfg.arms[name] for name in names})
    return cfg


if __name__ == "__main__":
    cfg = parse()
    # As every `python -m rstar2_jax` job: each RL run builds its own jitted steps, so without
    # the persistent cache every arm and seed compiles the same programs again (on a loaded
    # 2-core machine ~35 s for each new packed row count, most of a run's early steps).
    enable_persistent_cache()
    run_testbed(cfg)
    print(open(f"{cfg.out}/summary.md").read())
