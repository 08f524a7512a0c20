"""The RL steps compile a set of programs known before the first one (`rstar2_jax.rl.loop.
compile_set`, logged at the start), whatever rows each step keeps: counted by name in a fresh
process with a cold compilation cache, over steps that keep different numbers of rollouts.
Before, the update compiled per packed row count and the selection, the estimator and the
step's keys compiled one-operation programs per shape (the tiny demo's 4 RL steps: 142)."""
import json
import os
import subprocess
import sys

from rl_setup import copied_rl_setup, rl_overrides

_PROGRAM = """
import json, logging, sys
from rstar2_jax.compile_cache import CompileCounter, enable_persistent_cache
from rstar2_jax.config import load_config
from rstar2_jax import toy  # noqa: F401 -- registers the toy chat format
from rstar2_jax.rl import loop
from rstar2_jax.train.configs import RLJobConfig
from rstar2_jax.train.metrics import read_metrics


def main():
    # The job's INFO lines on stderr, as the CLI logs them (the compile set among them).
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("rstar2_jax").setLevel(logging.INFO)
    enable_persistent_cache()
    seen = {}
    synchronous = loop._synchronous

    def steps(rl_step, run, on_step):  # the run is set up: from here on, its steps
        seen["listed"], seen["before"] = loop.compile_set(rl_step), counter.snapshot()
        synchronous(rl_step, run, on_step)

    loop._synchronous = steps
    config = load_config(RLJobConfig, overrides=sys.argv[1:])
    with CompileCounter() as counter:
        loop.run_rl(config, progress=False)
    stats = counter.snapshot() - seen["before"]
    print(json.dumps({"listed": seen["listed"], "programs": stats.programs,
                      "loaded": stats.loaded,
                      "kept": [r["rollouts/kept"] for r in read_metrics(config.run_dir)]}))


if __name__ == "__main__":
    main()
"""


def test_rl_steps_compile_only_the_set_listed_at_the_start(tmp_path_factory, tmp_path):
    d = copied_rl_setup(tmp_path_factory, "compile_set")
    script = tmp_path / "count.py"
    script.write_text(_PROGRAM)
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache"))  # cold
    args = rl_overrides(d, "run", 4, "mesh.fsdp=1", "rl.mini_batches=2", "rl.micro_batch_size=2")
    done = subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True,
                          text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    listed, programs = result["listed"], result["programs"]
    # The steps met different row counts, each step's update its own micro-batches.
    assert len({k for k in result["kept"] if k}) >= 2, result["kept"]
    assert result["loaded"] == 0  # a cold cache: every program was compiled
    outside = {name: n for name, n in programs.items() if n > listed.get(name, 0)}
    assert not outside, f"compiled beyond the listed set {listed}: {outside}"
    # What the update compiles does not depend on the steps: each of its programs once.
    for name in ("jit(_logprob_pass)", "jit(_step_statistics)", "jit(micro_batch_layout)",
                 "jit(zero_accumulator)", "jit(add_micro_batch)", "jit(apply_update)"):
        assert programs.get(name) == 1, (name, programs)
    assert "RL steps compile at most" in done.stderr
