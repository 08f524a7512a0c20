"""The persistent compilation cache: where it lives, and that a second process compiles nothing
the first one compiled. Each case runs in a fresh interpreter, because JAX decides once per
process whether it uses a cache."""
import dataclasses
import json
import os
import subprocess
import sys

import pytest

_PROGRAM = """
import json, sys
import jax, jax.numpy as jnp
from rstar2_jax.compile_cache import CompileCounter, enable_persistent_cache

directory = enable_persistent_cache()
with CompileCounter() as counter:
    f = jax.jit(lambda x: jnp.tanh(x) @ x.T)
    for n in map(int, sys.argv[1:]):
        f(jnp.ones((n, n))).block_until_ready()
stats = counter.snapshot()
print(json.dumps({"dir": None if directory is None else str(directory),
                  "compiled": stats.compiled, "loaded": stats.loaded}))
"""


def _run(env_changes: dict, *sizes: int) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_COMPILATION_CACHE_DIR", "XDG_CACHE_HOME", "JAX_ENABLE_COMPILATION_CACHE")}
    env |= env_changes
    done = subprocess.run([sys.executable, "-c", _PROGRAM, *map(str, sizes)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_second_process_loads_what_the_first_compiled(tmp_path):
    env = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache")}
    first = _run(env, 8, 16)
    assert first["dir"] == str(tmp_path / "cache")
    assert first["compiled"] >= 2 and first["loaded"] == 0  # at least one program per shape
    second = _run(env, 8, 16)
    assert second == first | {"compiled": 0, "loaded": first["compiled"]}
    # A new shape is compiled; the known ones are still loaded.
    third = _run(env, 8, 16, 32)
    assert third["compiled"] >= 1 and third["loaded"] == first["compiled"]


def test_default_directory_is_the_users_cache_dir_never_the_working_directory(tmp_path):
    result = _run({"XDG_CACHE_HOME": str(tmp_path / "xdg")}, 8)
    assert result["dir"] == str(tmp_path / "xdg" / "rstar2_jax" / "jax")
    assert os.listdir(result["dir"])  # the compiled program was written there
    assert oct(os.stat(result["dir"]).st_mode & 0o777) == oct(0o700)


@pytest.mark.parametrize("env", [{"JAX_COMPILATION_CACHE_DIR": ""},
                                 {"JAX_ENABLE_COMPILATION_CACHE": "false"}])
def test_cache_can_be_turned_off(tmp_path, env):
    result = _run(env | {"XDG_CACHE_HOME": str(tmp_path)}, 8)
    assert result["dir"] is None and result["loaded"] == 0 and result["compiled"] >= 1
    assert not (tmp_path / "rstar2_jax").exists()


def test_programs_are_counted_by_name_and_a_phase_is_a_difference():
    import jax
    import numpy as np

    from rstar2_jax.compile_cache import CompileCounter

    with CompileCounter() as counter:
        jax.jit(lambda x: x + 1)(np.ones(3))  # the warm-up of a phase's count
        before = counter.snapshot()

        @jax.jit
        def twice(x):
            return 2 * x

        twice(np.ones(3))  # host inputs: nothing else compiles
        twice(np.ones(5))
    phase = counter.snapshot() - before
    assert phase.programs == {"jit(twice)": 2}
    assert phase.compiled + phase.loaded == 2
    assert json.loads(json.dumps(dataclasses.asdict(phase)))["programs"] == {"jit(twice)": 2}
