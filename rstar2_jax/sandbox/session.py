"""Tool sessions: the calls of one trajectory share state, as cells of a notebook do.

    with pool.session(seed=7) as session:
        session.submit("import math\\nx = 12").result()        # Tool call success
        session.submit("print(math.sqrt(x) ** 2)").result()    # 12.000000000000002

A session is the list of its trajectory's earlier cells. Each call runs in a fresh contained
child, like every call (docs/sandbox.md): the child first *replays* the earlier cells in one
namespace, their output suppressed and their exceptions swallowed, then runs the new cell as a
stateless call would. This is the semantics of the released rStar2-Agent ``jupyter_code`` tool
(which did not run as shipped), kept for three reasons:

- every isolation guarantee of a stateless call holds unchanged: nothing outlives a call, so a
  session holds no process, slot or memory between calls (a trajectory waiting on the model, or
  preempted by the sampler's engine, costs the pool nothing) and a cell that poisons its
  interpreter can only hurt the later cells of its own trajectory;
- a call is a pure function of (earlier cells, the session's seed, the new cell): a trajectory
  recomputed later gets the same outputs, and any template can serve any call;
- the measured cost at the turn counts of agentic math is small (docs/benchmarks.md).

Which cells replay: those that ran to their end or stopped on an exception (status ``ok`` or
``error`` with an exit code), so a cell that failed half-way leaves what it defined before the
failing line, as in a live kernel. Cells that timed out, ran out of memory or output, were
killed, or never started are left out: replaying them would only repeat the failure. The
random generators (``random``, ``numpy.random``, sympy's) start from the session's seed in
every call, so values drawn in earlier cells are drawn again identically. What replay cannot
reproduce: values from the OS (``os.urandom``, ``np.random.default_rng()`` without a seed, the
clock), input read from file descriptor 0 directly (replayed cells get their own stdin through
``sys.stdin``), and a cell that ends its own process (``os._exit``) ends every later call of the
session at that point. The call's deadline covers the replay, so a session's cells must stay
cheap together.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import Future
from typing import Callable, Sequence

from rstar2_jax.sandbox.result import ExecResult

Cell = tuple[str, str]
"""A cell of a session: ``(code, stdin)``."""

SubmitFn = Callable[..., Future]


def replays(result: ExecResult) -> bool:
    """Whether a cell with this result is replayed by the later calls of its session: it ran to
    its end or to an exception (``ok``, or ``error`` with an exit code; a call refused before it
    started has none)."""
    return result.status in ("ok", "error") and result.exit_code is not None


def new_seed() -> int:
    return int.from_bytes(os.urandom(8), "little") >> 1


class Session:
    """One trajectory's tool state (see the module docstring). Made by ``SandboxPool.session``.

    Calls run one at a time, in order: ``submit`` refuses while the previous call of the session
    has no result yet (its outcome decides whether it replays). ``close`` (or leaving a ``with``
    block) forgets the cells; the pool counts open sessions in ``health()["sessions"]``.
    """

    def __init__(self, submit: SubmitFn, seed: int, on_close: Callable[[], None],
                 check_may_wait: Callable[[], None] = lambda: None):
        self.seed = seed
        self._submit = submit
        self._on_close = on_close
        self._check_may_wait = check_may_wait  # raises where waiting for a result would deadlock
        self._cells: list[Cell] = []
        self._last: tuple[Cell, Future] | None = None
        self._closed = False
        self._lock = threading.Lock()

    @property
    def cells(self) -> tuple[Cell, ...]:
        """The cells the next call replays (earlier cells whose results are known)."""
        with self._lock:
            self._settle()
            return tuple(self._cells)

    @property
    def closed(self) -> bool:
        return self._closed

    def submit(self, code: str, stdin: str = "") -> Future:
        """Run ``code`` after the session's earlier cells; the future resolves to its
        ``ExecResult`` (never raises). RuntimeError while the previous call is in flight or
        after ``close``."""
        if not isinstance(code, str) or not isinstance(stdin, str):
            raise TypeError("code and stdin must be str")
        with self._lock:
            if self._closed:
                raise RuntimeError("submit() on a closed session")
            if self._last is not None and not self._last[1].done():
                raise RuntimeError("a session runs one call at a time: wait for the previous result")
            self._settle()
            future = self._submit(code, stdin, replay=tuple(self._cells), seed=self.seed)
            self._last = ((code, stdin), future)
            return future

    def run(self, code: str, stdin: str = "") -> ExecResult:
        """``submit`` and wait; RuntimeError from a done-callback of the pool's futures (see
        ``SandboxPool``: waiting there could never end)."""
        self._check_may_wait()
        return self.submit(code, stdin).result()

    def close(self) -> None:
        """Forget the cells; idempotent. A call still in flight resolves as usual."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._cells.clear()
            self._last = None
        self._on_close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _settle(self) -> None:
        """Append the previous call's cell if it replays (its result is known here)."""
        if self._last is not None and self._last[1].done():
            cell, future = self._last
            if replays(future.result()):
                self._cells.append(cell)
            self._last = None


def check_replay(replay: Sequence[Cell], seed: int | None) -> tuple[list[list[str]], int | None]:
    """``replay`` and ``seed`` as the template receives them; TypeError/ValueError otherwise."""
    cells = []
    for cell in replay:
        if not (isinstance(cell, tuple) and len(cell) == 2 and all(isinstance(x, str) for x in cell)):
            raise TypeError(f"a replayed cell is a (code, stdin) pair of strings, got {cell!r:.200}")
        cells.append(list(cell))
    if seed is not None and not (isinstance(seed, int) and 0 <= seed < 2**63):
        raise ValueError(f"seed must be an int in [0, 2**63), got {seed!r}")
    return cells, seed
