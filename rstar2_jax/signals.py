"""Signals that stop a job: the way Ctrl-C does, or after saving the step in flight.

SIGINT (Ctrl-C) raises KeyboardInterrupt in the main thread. Within `stop_on`, SIGTERM and
SIGHUP (what SLURM preemption, Kubernetes, ``docker stop`` and ``timeout`` send; a closed
terminal) raise `Stopped`, a KeyboardInterrupt, so a job unwinds the same way: the step in
flight is dropped, a checkpoint save in flight completes (`rstar2_jax.train.run.Run.close`),
the sandbox and verifier pools close, and the CLI prints how to resume and exits with
128 + the signal's number.

`SaveSignal` is the other way (``checkpoint.save_signal``): the signal is only recorded; the
run finishes the step in flight, saves it whether or not a checkpoint is due, and then stops
with `Stopped`. All processes of a run agree on it at the step's end, so they save the same
step together.
"""
from __future__ import annotations

import contextlib
import signal
from typing import Iterator

import jax
import numpy as np


class Stopped(KeyboardInterrupt):
    """A job stopped by signal ``signum``."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def stop_on(*signums: int) -> Iterator[None]:
    """Within: each of ``signums`` raises `Stopped` in the main thread; the previous handlers
    are restored after."""
    def stop(signum, frame):
        raise Stopped(signum)

    previous = {s: signal.signal(s, stop) for s in signums}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


class SaveSignal:
    """Records signal ``name`` (e.g. "USR1") instead of acting on it, until `close`; called
    from the main thread."""

    def __init__(self, name: str):
        self.signum = signal.Signals[f"SIG{name}"]
        self._received = False
        self._previous = signal.signal(self.signum, self._record)

    def _record(self, signum, frame) -> None:
        self._received = True

    def received(self) -> bool:
        """Whether any process of the run has received the signal. Every process calls this at
        the same point of the same step (a collective on several processes)."""
        if jax.process_count() == 1:
            return self._received
        from jax.experimental import multihost_utils

        return bool(np.any(multihost_utils.process_allgather(np.int32(self._received))))

    def close(self) -> None:
        signal.signal(self.signum, self._previous)
