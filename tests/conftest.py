"""Test configuration.

Eight fake CPU devices so that sharded code is exercised; the flag must be set before jax is
imported anywhere in the test process.

Most of the suite's time is XLA compiling small programs (85% of test_rl_update.py's on a
2-core machine, 238 programs). The tests check what programs compute, not how fast they run, so
they are compiled with few optimizations (JAX's ``jax_disable_most_optimizations``: half the
compile time) and by XLA:CPU's older loop emitters (``--xla_cpu_use_fusion_emitters=false``:
the RL train step of the tiny test model, ~290 kernels, compiles in 0.9-1.5 s instead of
4.7-5.2 s), and every test process and the processes they start (CLI runs, notebook kernels,
multi-process runs) share one persistent compilation cache for the session, so that a program
compiled once is loaded by the next test that builds it (a quarter of that module's programs).
Both are environment variables, inherited by the pytest-xdist workers and by subprocesses; a
``JAX_COMPILATION_CACHE_DIR`` set by the caller is used as it is.

PyTorch (the reference the parity tests compare against) runs on one OpenMP thread: its
threads spin while they wait, and beside XLA's threads and the other worker on 2 cores
transformers' greedy generation of 150 tokens of a tiny model took 35-43 s instead of 3.5 s.
"""
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
if "xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "true")
_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    # Created by the first process that reads this file (pytest's main process); the workers
    # it starts inherit the variable and find it set.
    _OWN_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="rstar2-tests-jax-")
# JAX caches only programs that took over a second to compile, by default: most of these.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")


def pytest_unconfigure(config):
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)
