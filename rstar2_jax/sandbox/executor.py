"""The interface the sampler and trainer code against, so a remote backend can replace the pool.

``SandboxPool`` is the local implementation. A remote one (one pool server per CPU host with
client-side least-outstanding routing, see docs/sandbox.md) implements the same methods and
returns the same ``ExecResult``s. A session's calls are ordinary calls that carry the cells to
replay (``submit(..., replay=, seed=)``), so any host can serve any of them.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Protocol, Sequence, Union, runtime_checkable

from rstar2_jax.sandbox.result import ExecResult
from rstar2_jax.sandbox.session import Session

Call = Union[str, tuple[str, str]]
"""A tool call: a code string, or a ``(code, stdin)`` pair."""


def as_code_and_stdin(call: Call) -> tuple[str, str]:
    """Normalise a ``Call``; raise TypeError for anything else (never guess)."""
    if isinstance(call, str):
        return call, ""
    if isinstance(call, tuple) and len(call) == 2 and all(isinstance(x, str) for x in call):
        return call
    raise TypeError(f"a call is a code string or a (code, stdin) pair of strings, got {call!r:.200}")


@runtime_checkable
class Executor(Protocol):
    def submit(self, code: str, stdin: str = "", *, replay: Sequence[tuple[str, str]] = (),
               seed: int | None = None) -> Future[ExecResult]:
        """Start one call; the future always resolves to an ExecResult (never an exception).
        ``replay``/``seed``: a session's earlier cells and seed (`rstar2_jax.sandbox.session`)."""

    def session(self, seed: int | None = None) -> Session:
        """A new tool session: calls that share state (`rstar2_jax.sandbox.session`)."""

    def run_batch(self, calls: Sequence[Call]) -> list[ExecResult]:
        """Run calls concurrently; results in submission order."""

    def stats(self) -> dict:
        """Counters since start (calls, statuses, respawns, queue wait, ...)."""

    def close(self) -> None:
        """Stop; calls still queued or running resolve as ``sandbox_error``."""
