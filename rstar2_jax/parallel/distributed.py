"""Several JAX processes as one run: joining them at start-up, and a launcher for one machine.

Every entry point (``python -m rstar2_jax <job>``) calls :func:`initialize_from_env` before it
touches JAX. The processes of a run find each other through

    JAX_COORDINATOR_ADDRESS   host:port that process 0 listens on (the same for every process)
    JAX_NUM_PROCESSES         how many processes the run has
    JAX_PROCESS_ID            this process's index, 0 .. JAX_NUM_PROCESSES - 1

or, without them, through the variables of a SLURM (``srun``) or Open MPI (``mpirun``) launch
of more than one task, which JAX reads itself. With none of these a job runs as one process.
:func:`launch` (``python -m rstar2_jax launch --processes N <job> ...``) sets the three
variables for N processes on this machine. docs/scale_plan.md shows both.

A process that dies stops the others: JAX's coordination service misses its heartbeats for
``HEARTBEAT_TIMEOUT_S`` and aborts every other process with a message saying a task died.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Mapping, Sequence

from rstar2_jax.errors import ConfigError

# Seconds without a heartbeat after which a process counts as dead (JAX's default is 100). A
# peer that is only busy (compiling, sampling) keeps beating: a background thread sends them.
HEARTBEAT_TIMEOUT_S = 30


def initialize_from_env(environ: Mapping[str, str] = os.environ) -> bool:
    """Joins this process to the run's others when the environment describes several processes
    (see the module docstring); returns whether it did. Call it before anything uses JAX.

    Raises ConfigError for an incomplete or inconsistent description.
    """
    if "JAX_NUM_PROCESSES" in environ:
        names = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
        missing = [name for name in names if not environ.get(name)]
        if missing:
            raise ConfigError(f"a multi-process run needs {', '.join(names)}; "
                             f"{', '.join(missing)} not set")
        try:
            count, index = int(environ["JAX_NUM_PROCESSES"]), int(environ["JAX_PROCESS_ID"])
        except ValueError:
            raise ConfigError("JAX_NUM_PROCESSES and JAX_PROCESS_ID must be integers, got "
                             f"{environ['JAX_NUM_PROCESSES']!r} and {environ['JAX_PROCESS_ID']!r}") from None
        if not 0 <= index < count:
            raise ConfigError(f"JAX_PROCESS_ID={index} is not in 0 .. {count - 1} "
                             f"(JAX_NUM_PROCESSES={count})")
        where = {"coordinator_address": environ["JAX_COORDINATOR_ADDRESS"],
                 "num_processes": count, "process_id": index}
    elif int(environ.get("SLURM_NTASKS", "1")) > 1 or int(environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        where = {}  # JAX reads the cluster's own variables
    else:
        return False
    import jax

    # Cross-process collectives of the CPU backend (tests, CPU-only clusters); GPU and TPU
    # backends bring their own.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**where, heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S)
    return True


def require_single_process(job: str) -> None:
    """Raises ConfigError for a job that does not run across processes yet."""
    import jax

    if jax.process_count() > 1:
        raise ConfigError(f"{job} does not run across processes yet (this is process "
                                  f"{jax.process_index()} of {jax.process_count()}); run it as one "
                                  f"process")


def free_port() -> int:
    """A TCP port on this machine that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(processes: int, job_args: Sequence[str], *, port: int | None = None,
           grace_s: float = 10.0) -> int:
    """Runs ``python -m rstar2_jax <job_args>`` as ``processes`` processes of one run on this
    machine and waits for them. Returns 0 if all succeed; otherwise the first failure's exit
    status (128 + the signal number for a killed process), after stopping the others
    (SIGTERM, then SIGKILL after ``grace_s``) rather than leaving them to wait for it.

    Each process sees all of this machine's devices unless its environment says otherwise
    (e.g. ``XLA_FLAGS=--xla_force_host_platform_device_count=2`` on CPU).
    """
    if processes < 1:
        raise ConfigError(f"--processes must be >= 1, got {processes}")
    address = f"127.0.0.1:{port or free_port()}"
    children = []
    for index in range(processes):
        env = dict(os.environ, JAX_COORDINATOR_ADDRESS=address,
                   JAX_NUM_PROCESSES=str(processes), JAX_PROCESS_ID=str(index))
        children.append(subprocess.Popen([sys.executable, "-m", "rstar2_jax", *job_args], env=env))
    failed = None
    try:
        while failed is None and any(c.poll() is None for c in children):
            failed = next((c for c in children if c.returncode not in (None, 0)), None)
            time.sleep(0.2)
        failed = failed or next((c for c in children if c.returncode), None)
    finally:
        _stop(children, grace_s)
    if failed is None:
        return 0
    print(f"launch: process {children.index(failed)} exited with status {failed.returncode}; "
          f"stopped the others", file=sys.stderr)
    return failed.returncode if failed.returncode > 0 else 128 - failed.returncode


def _stop(children: list[subprocess.Popen], grace_s: float) -> None:
    running = [c for c in children if c.poll() is None]
    for c in running:
        c.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for c in running:
        try:
            c.wait(max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            c.kill()
            c.wait()
