"""Handing a running sampler new weights: a mailbox the trainer posts to from any thread.

The sampler's loop takes from it between device calls (`AgentSampler` before each decode call),
never during one, so a call runs wholly under one policy version. Only the newest post counts:
a sampler that falls behind skips straight to the latest weights.
"""
from __future__ import annotations

import threading
from typing import Any, NamedTuple


class WeightUpdate(NamedTuple):
    params: Any
    version: int


class WeightUpdates:
    """The newest weights posted and not yet taken; thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pending: WeightUpdate | None = None

    def post(self, params, version: int) -> None:
        """Offers ``params`` as policy ``version``. The caller must not donate or modify them
        afterwards: the sampler reads them when it takes them. A post older than one pending is
        ignored."""
        with self._lock:
            if self._pending is None or version > self._pending.version:
                self._pending = WeightUpdate(params, version)

    def take(self, newer_than: int) -> WeightUpdate | None:
        """The pending update if its version is above ``newer_than`` (else None); empties the
        mailbox either way."""
        with self._lock:
            update, self._pending = self._pending, None
        return update if update is not None and update.version > newer_than else None
