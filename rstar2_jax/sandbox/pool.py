"""``SandboxPool``: the local executor. Parent-side bookkeeping; the calls run in templates.

Threads in the caller's process (they only move bytes; no fork happens here, so the pool is safe
to create from a process that already runs JAX):

- dispatcher: takes queued calls in submission order and sends each to the live template with
  the fewest calls in flight, at most ``slots_per_worker`` per template;
- reader: receives results and resolves futures, notices dead or wedged templates, fails their
  in-flight calls with ``sandbox_error`` and starts replacements.

Sending and receiving live in different threads so that a template blocked on sending a large
result can never deadlock against a parent blocked on sending it a large request.

Templates are fresh interpreters (``python -P -m rstar2_jax.sandbox.template``) rather than
``multiprocess`` spawn children: spawn re-imports the parent's ``__main__``, which in a training
script imports JAX and numpy before the BLAS thread pin could apply. Their environment is built
from nothing (``template_environment``), never copied from the caller, so no token or key of the
trainer reaches a template's memory, and so none reaches a call's. The channel to each template
is a pair of ``multiprocess.connection`` pipes carrying JSON bytes, never pickles.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import logging
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from typing import Sequence

from multiprocess.connection import Connection, wait

import rstar2_jax
from rstar2_jax.sandbox.config import SandboxConfig, default_num_workers, pool_memory_bytes
from rstar2_jax.sandbox.executor import Call, as_code_and_stdin
from rstar2_jax.sandbox.result import STATUSES, ExecResult, sandbox_error
from rstar2_jax.sandbox.session import Cell, Session, check_replay, new_seed

# A template imports numpy and sympy: seconds on an idle machine, minutes on a loaded one. One
# that lives is waited for, however long (a deadline that load can reach fails a sound run), with
# a warning every `_STARTUP_WARN_S`; what ends a crash loop is a count of deaths, not a clock.
_STARTUP_WARN_S = 120.0
_STARTUP_DEATHS = 3  # a template that dies this many times before it is first ready fails the pool
_WEDGED_GRACE_S = 10.0  # a template that has not answered by deadline + this is killed
_RESPAWN_DELAY_S = 1.0  # after a replacement failed to start
_UID_BLOCK = 4096  # slot uids per pool
_pool_serial = itertools.count()
log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Pending:
    id: int
    code: str
    stdin: str
    replay: list[list[str]]
    seed: int | None
    future: Future
    submitted: float


@dataclasses.dataclass
class _Worker:
    index: int
    proc: subprocess.Popen
    conn_in: Connection  # template -> pool
    conn_out: Connection  # pool -> template
    ready: bool = False
    dead: bool = False
    pid: int | None = None
    inflight: dict[int, tuple[_Pending, float]] = dataclasses.field(default_factory=dict)


# The caller's variables that say where the interpreter and its packages are; nothing else of
# its environment is passed on.
_LOCATION_VARIABLES = ("HOME", "PYTHONHOME", "PYTHONUSERBASE", "PYTHONNOUSERSITE", "LD_LIBRARY_PATH")


def template_environment() -> dict[str, str]:
    """The environment of a template, built from scratch: fixed settings, the location
    variables of the caller, and a PYTHONPATH that finds this package first (relative entries
    resolved against the caller's working directory, since templates run in ``/``)."""
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(rstar2_jax.__file__)))
    python_path = [package_root] + [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {name: os.environ[name] for name in _LOCATION_VARIABLES if name in os.environ}
    env.update(PATH="/usr/local/bin:/usr/bin:/bin", LANG="C.UTF-8", PYTHONHASHSEED="0",
               OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(python_path))
    return env


def _uid_base() -> int:
    # Distinct pools (in this or other processes) get distinct slot uids, so RLIMIT_NPROC of
    # one pool's calls never counts another's processes. Above 65535: clear of real users.
    block = (os.getpid() * 64 + next(_pool_serial)) % 65536
    return 65536 + block * _UID_BLOCK


class SandboxPool:
    """A pool of warm template processes that run Python tool calls in contained children.

    Usage::

        with SandboxPool(timeout_s=4.0) as pool:
            pool.run("print(2 + 2)").stdout          # '4\\n'
            pool.run_batch(["1 + 1", ("print(input())", "hi")])
            future = pool.submit(code)               # overlap with decoding; poll future.done()
            with pool.session() as s:                # one trajectory's calls share state
                s.run("x = 41"); s.run("x + 1").stdout     # '42\n'

    Args:
      num_workers: template processes; default one per usable core.
      timeout_s: wall-clock limit per call, seconds.
      **limits: any other ``SandboxConfig`` field (memory_bytes, output_limit_bytes,
        slots_per_worker, isolation, ...).

    Every submitted call resolves to exactly one ``ExecResult``, whatever the code does.
    Futures are resolved, and so their done-callbacks run, on the pool's reader thread: a
    callback may ``submit`` or ``close``, but waiting there (``run``, ``run_batch``) could never
    end and raises RuntimeError; keep callbacks short, since results wait while one runs.
    """

    def __init__(self, num_workers: int | None = None, timeout_s: float = 4.0, **limits):
        config = SandboxConfig(timeout_s=timeout_s, **limits)
        self.num_workers = default_num_workers() if num_workers is None else num_workers
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        # Resolved once: every template, replacements included, gets the same share.
        self.config = dataclasses.replace(config, pool_memory_bytes=pool_memory_bytes(config, self.num_workers))
        if self.num_workers * self.config.slots_per_worker > _UID_BLOCK:
            raise ValueError(f"num_workers * slots_per_worker must be <= {_UID_BLOCK}")
        self._uid_base = _uid_base()
        # Built once: a replacement template starts exactly like the first ones.
        self._env = template_environment()
        self.memory_limit: str | None = None
        self.cpu_limit: str | None = None
        self._lock = threading.Condition()
        self._queue: collections.deque[_Pending] = collections.deque()
        self._ids = itertools.count()
        self._closing = False
        self._respawn_at: dict[int, float] = {}
        self._startup_deaths = collections.Counter()  # per template index, until the pool is up
        self._counts = collections.Counter()
        self._sessions = 0
        self._queue_waits: collections.deque[float] = collections.deque(maxlen=10_000)
        self.level: str | None = None
        self._workers = [self._spawn(i) for i in range(self.num_workers)]
        self._startup_error: str | None = None
        self._reader = threading.Thread(target=self._read_loop, name="sandbox-reader", daemon=True)
        self._dispatcher = threading.Thread(target=self._dispatch_loop, name="sandbox-dispatch", daemon=True)
        self._reader.start()
        started = time.monotonic()
        warn_at = started + _STARTUP_WARN_S
        with self._lock:
            while not all(w.ready for w in self._workers) and self._startup_error is None:
                self._lock.wait(timeout=max(warn_at - time.monotonic(), 0.0))
                if time.monotonic() >= warn_at:
                    ready = sum(w.ready for w in self._workers)
                    log.warning("sandbox pool: %d of %d templates ready after %.0f s; still waiting "
                                "(the machine may be loaded)", ready, self.num_workers, warn_at - started)
                    warn_at += _STARTUP_WARN_S
            self._startup_deaths = None  # replacements after start-up are respawned, as before
        if self._startup_error is not None:
            self.close()
            raise RuntimeError(f"sandbox pool failed to start: {self._startup_error}")
        self._dispatcher.start()

    # -- public API ----------------------------------------------------------------------------
    def submit(self, code: str, stdin: str = "", *, replay: Sequence[Cell] = (),
               seed: int | None = None) -> Future:
        """Queue one call; the returned future resolves to its ExecResult (never raises).

        ``replay`` and ``seed`` are what a `Session` passes: cells ``(code, stdin)`` run first in
        the same child, output suppressed and exceptions swallowed, with the random generators
        seeded from ``seed`` (None: from the OS, as for every stateless call).
        """
        if not isinstance(code, str) or not isinstance(stdin, str):
            raise TypeError("code and stdin must be str")
        cells, seed = check_replay(replay, seed)
        future: Future = Future()
        with self._lock:
            if self._closing:
                raise RuntimeError("submit() on a closed SandboxPool")
            self._queue.append(_Pending(next(self._ids), code, stdin, cells, seed, future, time.monotonic()))
            self._counts["calls"] += 1
            self._lock.notify_all()
        return future

    def session(self, seed: int | None = None) -> Session:
        """A new tool session: its calls share state by replaying its earlier cells (see
        `rstar2_jax.sandbox.session`). ``seed`` (default: from the OS) seeds the random
        generators of each of its calls, so that replayed cells draw what they drew before."""
        _, seed = check_replay((), new_seed() if seed is None else seed)
        session = Session(self.submit, seed, self._session_closed, self._check_may_wait)
        with self._lock:
            if self._closing:
                raise RuntimeError("session() on a closed SandboxPool")
            self._sessions += 1
            self._counts["sessions"] += 1
        return session

    def _session_closed(self) -> None:
        with self._lock:
            self._sessions -= 1

    def run(self, code: str, stdin: str = "") -> ExecResult:
        return self.run_batch([(code, stdin)])[0]

    def run_batch(self, calls: Sequence[Call]) -> list[ExecResult]:
        """Run all calls concurrently; results in submission order."""
        self._check_may_wait()
        futures = [self.submit(*as_code_and_stdin(c)) for c in calls]
        return [f.result() for f in futures]

    def _check_may_wait(self) -> None:
        if threading.current_thread() is self._reader:
            raise RuntimeError("run()/run_batch() from a done-callback of this pool's futures would wait for "
                               "the thread that runs the callback; use submit() there")

    def stats(self) -> dict:
        """Counters since start: calls, one count per status, respawns, sessions opened, queue
        wait (seconds)."""
        with self._lock:
            waits = sorted(self._queue_waits) or [0.0]
            out = {"calls": self._counts["calls"], "completed": self._counts["completed"],
                   "respawns": self._counts["respawns"], "sessions": self._counts["sessions"]}
            out.update({s: self._counts[s] for s in STATUSES})
            out.update(queue_wait_p50_s=waits[len(waits) // 2],
                       queue_wait_p99_s=waits[min(len(waits) - 1, int(0.99 * len(waits)))],
                       queue_wait_max_s=waits[-1])
            return out

    def health(self) -> dict:
        """Liveness: live templates and their pids, isolation level, how a call's memory is
        bounded ("cgroup v1", "cgroup v2" or "rlimit") and its CPU ("cgroup v1", "cgroup v2"
        or "none"), the uids calls run as, queued and in-flight calls, open sessions."""
        with self._lock:
            live = [w for w in self._workers if w.ready and not w.dead]
            return {"healthy": len(live) == self.num_workers and not self._closing,
                    "workers": self.num_workers, "live_workers": len(live),
                    "template_pids": [w.pid for w in live], "isolation": self.level,
                    "memory_limit": self.memory_limit, "cpu_limit": self.cpu_limit,
                    "slot_uids": (self._uid_base, self._uid_base + self.num_workers * self.config.slots_per_worker - 1),
                    "queued": len(self._queue),
                    "in_flight": sum(len(w.inflight) for w in self._workers),
                    "sessions": self._sessions}

    def close(self) -> None:
        """Stop the templates (killing their calls); unfinished calls resolve as sandbox_error."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            queued = list(self._queue)
            self._queue.clear()
            self._lock.notify_all()
        for p in queued:
            self._resolve(p, sandbox_error("pool closed"))
        if self._dispatcher.is_alive():
            self._dispatcher.join()
        for w in self._workers:
            try:
                w.conn_out.send_bytes(b'{"op": "shutdown"}')
            except OSError:
                pass
        for w in self._workers:
            try:
                w.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
        if threading.current_thread() is not self._reader:  # close() from a done-callback
            self._reader.join(timeout=30)
        for w in self._workers:
            self._fail_inflight(w, "pool closed")
            w.conn_in.close()
            w.conn_out.close()

    def __enter__(self) -> "SandboxPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------------
    def _spawn(self, index: int) -> _Worker:
        to_template_r, to_template_w = os.pipe()
        from_template_r, from_template_w = os.pipe()
        # -P: the working directory ("/") is not put on sys.path (calls would see all of it).
        argv = [sys.executable, "-P", "-m", "rstar2_jax.sandbox.template", str(to_template_r),
                str(from_template_w), str(index), str(self.num_workers), str(self._uid_base), self.config.to_json()]
        # subprocess uses fork+exec in C with no Python running in between: safe beside JAX threads.
        # A process group of its own: a terminal's Ctrl-C goes to the caller, which closes the pool,
        # and not to the template, which would die on it with a traceback.
        proc = subprocess.Popen(argv, pass_fds=(to_template_r, from_template_w), env=self._env, cwd="/",
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, process_group=0)
        os.close(to_template_r)
        os.close(from_template_w)
        return _Worker(index, proc, Connection(from_template_r, writable=False),
                       Connection(to_template_w, readable=False))

    def _resolve(self, pending: _Pending, result: ExecResult) -> None:
        with self._lock:
            self._counts["completed"] += 1
            self._counts[result.status] += 1
        pending.future.set_result(result)

    def _fail_inflight(self, worker: _Worker, why: str) -> None:
        with self._lock:
            lost = [p for p, _ in worker.inflight.values()]
            worker.inflight.clear()
        for p in lost:
            self._resolve(p, sandbox_error(why))

    def _dispatch_loop(self) -> None:
        while True:
            with self._lock:
                while True:
                    if self._closing:
                        return
                    free = [w for w in self._workers if w.ready and not w.dead
                            and len(w.inflight) < self.config.slots_per_worker]
                    if self._queue and free:
                        break
                    self._lock.wait()
                worker = min(free, key=lambda w: len(w.inflight))
                pending = self._queue.popleft()
                now = time.monotonic()
                worker.inflight[pending.id] = (pending, now)
                self._queue_waits.append(now - pending.submitted)
            message = {"op": "run", "id": pending.id, "code": pending.code, "stdin": pending.stdin,
                       "replay": pending.replay, "seed": pending.seed}
            try:
                worker.conn_out.send_bytes(json.dumps(message).encode())
            except OSError:
                pass  # the template died; the reader fails this call with its other in-flight ones

    def _on_message(self, worker: _Worker, message: dict) -> None:
        op = message["op"]
        if op == "result":
            with self._lock:
                entry = worker.inflight.pop(message["id"], None)
                self._lock.notify_all()
            if entry is not None:
                self._resolve(entry[0], ExecResult.from_dict(message["result"]))
        elif op == "ready":
            with self._lock:
                worker.ready, worker.pid = True, message["pid"]
                bounds = (message["level"], message["memory"], message["cpu"])
                if self.level is None:
                    self.level, self.memory_limit, self.cpu_limit = bounds
                elif bounds != (self.level, self.memory_limit, self.cpu_limit):
                    # Isolation must not silently weaken when a template is replaced.
                    self._startup_error = (f"template started with isolation, memory and CPU bounds {bounds}; "
                                           f"the pool has {(self.level, self.memory_limit, self.cpu_limit)}")
                    worker.proc.kill()
                self._lock.notify_all()
        elif op == "fatal":
            with self._lock:
                if not all(w.ready for w in self._workers) and self.level is None:
                    self._startup_error = message["error"]
                self._lock.notify_all()

    def _on_death(self, worker: _Worker) -> None:
        with self._lock:
            worker.dead = True
            self._lock.notify_all()
        try:
            worker.proc.kill()
        except ProcessLookupError:
            pass
        worker.proc.wait()
        self._fail_inflight(worker, f"template {worker.index} died (exit {worker.proc.returncode})")
        with self._lock:
            if self._closing or self._startup_error is not None:
                return
            was_ready = worker.ready
            if not was_ready and self._startup_deaths is not None:
                self._startup_deaths[worker.index] += 1
                if self._startup_deaths[worker.index] >= _STARTUP_DEATHS:
                    self._startup_error = (f"template {worker.index} exited {_STARTUP_DEATHS} times before it "
                                           f"was ready (last exit code {worker.proc.returncode}; its "
                                           f"traceback, if any, is above)")
                    self._lock.notify_all()
                    return
            self._respawn_at[worker.index] = time.monotonic() + (0.0 if was_ready else _RESPAWN_DELAY_S)

    def _read_loop(self) -> None:
        while True:
            with self._lock:
                if self._closing and all(w.dead or w.proc.poll() is not None for w in self._workers):
                    return
                now = time.monotonic()
                for index, when in list(self._respawn_at.items()):
                    if now >= when and not self._closing:
                        del self._respawn_at[index]
                        old = self._workers[index]
                        old.conn_in.close()
                        old.conn_out.close()
                        self._workers[index] = self._spawn(index)
                        self._counts["respawns"] += 1
                workers = [w for w in self._workers if not w.dead]
                wedged = [w for w in workers if any(
                    now > sent + self.config.timeout_s + _WEDGED_GRACE_S for _, sent in w.inflight.values())]
            for w in wedged:
                w.proc.kill()  # its channel then reports EOF below
            by_conn = {w.conn_in: w for w in workers}
            for conn in wait(list(by_conn), timeout=0.25):
                worker = by_conn[conn]
                try:
                    message = json.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    self._on_death(worker)
                    continue
                self._on_message(worker, message)
