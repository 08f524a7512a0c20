"""Score rollouts in killable worker processes, with a cache for repeated answers.

`VerifierPool` is how the trainer computes the outcome reward. Verification is trusted code on
untrusted strings, so workers are persistent (no per-call fork) but disposable: some answers
make sympy grind on huge integers in C code (math-verify issue #65, e.g. `5^{5^{5^{5}}}`), which
no in-process timeout can interrupt. The parent therefore watches every call; when one outlives
`timeout_s` it SIGKILLs the worker, scores the call 0 and spawns a replacement.

Workers are started with the spawn method of `multiprocess`: the trainer has already started
JAX's threads and must never be forked. Requests and replies are JSON bytes over a pipe, never
pickles. One parent thread drives each worker, so the parent never blocks on a busy worker and
submitting is non-blocking (`submit` returns a future, letting the RL loop overlap scoring with
rollouts).

Caching happens in the parent, keyed on (extracted answer, gold): a GRPO group of 16-32
rollouts usually repeats a handful of answers, so a group costs a few verifications, and a
pair already in flight is shared rather than verified twice.
"""

import collections
import concurrent.futures
import dataclasses
import json
import logging
import os
import queue
import resource
import threading

import multiprocess

from rstar2_jax.rewards.extract import extract_answer

logger = logging.getLogger(__name__)

# A verification that needs more memory than this is pathological; fail it fast (score 0)
# rather than let it swap the host.
_WORKER_MEMORY_BYTES = 4 << 30
# Spawning a worker imports sympy and math-verify: seconds on a loaded 2-core machine.
_STARTUP_TIMEOUT_S = 120.0
_READY = b"ready"


def _serve(connection) -> None:
    """Worker main loop: read `[pred, gold]` JSON, reply `{"equal": bool}` or `{"error": str}`."""
    resource.setrlimit(resource.RLIMIT_AS, (_WORKER_MEMORY_BYTES, _WORKER_MEMORY_BYTES))
    from rstar2_jax.rewards.verify import is_equivalent

    # Touch every code path once so the first real call does not pay sympy's lazy imports.
    is_equivalent("\\frac{2}{4}", "0.5")
    is_equivalent("x^2 - 1", "(x-1)(x+1)")
    connection.send_bytes(_READY)
    while True:
        try:
            pred, gold = json.loads(connection.recv_bytes())
        except EOFError:  # the pool closed the pipe: shut down
            return
        try:
            reply = {"equal": bool(is_equivalent(pred, gold))}
        except Exception as error:  # scored 0 by the parent; reported, never fatal
            reply = {"error": f"{type(error).__name__}: {error}"}
        connection.send_bytes(json.dumps(reply).encode())


class _Worker:
    """One spawned verifier process and the parent's end of its pipe."""

    def __init__(self, context):
        self.connection, child_end = context.Pipe(duplex=True)
        self.process = context.Process(target=_serve, args=(child_end,), daemon=True)
        self.process.start()
        child_end.close()
        try:
            ready = self.connection.poll(_STARTUP_TIMEOUT_S)
            ready = ready and self.connection.recv_bytes() == _READY
        except EOFError:
            ready = False
        if not ready:
            self.kill()
            raise RuntimeError(
                f"verifier worker did not start within {_STARTUP_TIMEOUT_S} s (exit code "
                f"{self.process.exitcode}); a script that starts a VerifierPool needs an "
                "`if __name__ == '__main__':` guard, as spawned workers re-import the main module"
            )

    def call(self, pred: str, gold: str, timeout_s: float) -> dict | str:
        """The worker's reply, or `"timeout"` / `"died"` if it missed the deadline or crashed."""
        try:
            self.connection.send_bytes(json.dumps([pred, gold]).encode())
            if not self.connection.poll(timeout_s):
                return "timeout"
            return json.loads(self.connection.recv_bytes())
        except (EOFError, OSError):
            return "died"

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.connection.close()

    def stop(self) -> None:
        """Let the worker exit on end-of-pipe; kill it if it does not."""
        self.connection.close()
        self.process.join(timeout=5.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


@dataclasses.dataclass(frozen=True)
class VerifierStats:
    """Counters since the pool started. `calls` counts submissions; each is answered by the
    cache (`cache_hits`, including pairs already in flight), without verification (no boxed
    answer: `no_answer`) or by a worker (`verified`), of which `timeouts` were killed and
    `errors` raised or crashed. `respawns` counts replacement workers."""

    calls: int
    cache_hits: int
    no_answer: int
    verified: int
    timeouts: int
    errors: int
    respawns: int


class VerifierPool:
    """Binary outcome rewards from `num_workers` killable verifier processes.

    Usage:
        with VerifierPool(num_workers=2, timeout_s=4.0) as pool:
            rewards = pool.score_batch([(response_text, gold), ...])  # list of 0.0 / 1.0

    A call taking longer than `timeout_s` seconds of wall time in its worker scores 0.0 (that
    worker is killed and replaced). The scoring rule is `rstar2_jax.rewards.score`'s.
    `num_workers` defaults to min(4, CPUs). Thread-safe; `cache_size` bounds the
    (answer, gold) -> reward memo (LRU). A call whose worker could not be started gets that
    error as its future's exception; every submitted call gets exactly one outcome.

    Workers are spawned, so they re-import the main module: a script that creates a pool needs
    the usual `if __name__ == "__main__":` guard (notebooks and pytest need nothing).
    """

    def __init__(
        self, num_workers: int | None = None, timeout_s: float = 4.0, cache_size: int = 1 << 16
    ):
        if num_workers is None:
            num_workers = min(4, os.cpu_count() or 1)
        if num_workers < 1 or timeout_s <= 0 or cache_size < 0:
            raise ValueError(
                f"need num_workers >= 1, timeout_s > 0, cache_size >= 0; got "
                f"{num_workers}, {timeout_s}, {cache_size}"
            )
        self.timeout_s = timeout_s
        self._cache_size = cache_size
        self._context = multiprocess.get_context("spawn")
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[tuple[str, str], float] = collections.OrderedDict()
        self._in_flight: dict[tuple[str, str], concurrent.futures.Future] = {}
        self._counts = collections.Counter()
        self._jobs: queue.Queue = queue.Queue()
        self._closed = False
        # Start all workers concurrently: each one spends seconds importing sympy.
        with concurrent.futures.ThreadPoolExecutor(num_workers) as starter:
            starting = [starter.submit(_Worker, self._context) for _ in range(num_workers)]
            concurrent.futures.wait(starting)
        failed = [future.exception() for future in starting if future.exception() is not None]
        if failed:
            for future in starting:
                if future.exception() is None:
                    future.result().kill()
            raise failed[0]
        self._workers: list[_Worker | None] = [future.result() for future in starting]
        self._threads = [
            threading.Thread(target=self._drive, args=(slot,), name=f"verifier-{slot}", daemon=True)
            for slot in range(num_workers)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, response_text: str, gold: str) -> concurrent.futures.Future:
        """The reward of one response as a future float (0.0 or 1.0); never blocks."""
        answer = extract_answer(response_text)
        with self._lock:
            if self._closed:
                raise RuntimeError("VerifierPool is closed")
            self._counts["calls"] += 1
            if answer is None:
                self._counts["no_answer"] += 1
                return _done(0.0)
            key = (answer, gold)
            if key in self._cache:
                self._counts["cache_hits"] += 1
                self._cache.move_to_end(key)
                return _done(self._cache[key])
            if key in self._in_flight:
                self._counts["cache_hits"] += 1
                return self._in_flight[key]
            future = concurrent.futures.Future()
            self._in_flight[key] = future
        self._jobs.put((key, future))
        return future

    def score_batch(self, items: list[tuple[str, str]]) -> list[float]:
        """Rewards of `(response_text, gold)` pairs, in order."""
        futures = [self.submit(response_text, gold) for response_text, gold in items]
        return [future.result() for future in futures]

    def stats(self) -> VerifierStats:
        with self._lock:
            names = [field.name for field in dataclasses.fields(VerifierStats)]
            return VerifierStats(**{name: self._counts[name] for name in names})

    def close(self) -> None:
        """Finish the calls already submitted, then stop the workers."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for _ in self._threads:
            self._jobs.put(None)
        for thread in self._threads:
            thread.join()
        for worker in self._workers:
            if worker is not None:
                worker.stop()

    def __enter__(self) -> "VerifierPool":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _drive(self, slot: int) -> None:
        """Thread body: feed jobs to worker `slot` one at a time, replacing it when it fails."""
        while (job := self._jobs.get()) is not None:
            key, future = job
            try:
                reward = self._verify(slot, self._worker(slot), *key)
            except Exception as error:  # e.g. no replacement worker: the caller must hear of it
                self._finish(key, future, error=error)
                continue
            self._finish(key, future, reward=reward)
            if self._workers[slot] is None and not self._closed:
                # Respawn now, after delivering the result, so the next job does not wait;
                # a failure here is retried (and reported) by the next job.
                try:
                    self._worker(slot)
                except Exception:
                    logger.exception("could not replace verifier worker %d", slot)

    def _worker(self, slot: int) -> _Worker:
        """The live worker of `slot`, replacing one that is missing or died while idle."""
        if self._workers[slot] is not None and not self._workers[slot].process.is_alive():
            self._workers[slot].kill()
            self._workers[slot] = None
        if self._workers[slot] is None:
            self._workers[slot] = _Worker(self._context)
            self._count("respawns")
        return self._workers[slot]

    def _verify(self, slot: int, worker: _Worker, pred: str, gold: str) -> float:
        reply = worker.call(pred, gold, self.timeout_s)
        self._count("verified")
        if isinstance(reply, str):
            worker.kill()
            self._workers[slot] = None
            self._count("timeouts" if reply == "timeout" else "errors")
            logger.warning("verifier worker %s on %r vs %r; scored 0", reply, pred[:80], gold[:80])
            return 0.0
        if "error" in reply:
            self._count("errors")
            logger.warning(
                "verifier error on %r vs %r: %s; scored 0", pred[:80], gold[:80], reply["error"]
            )
            return 0.0
        return float(reply["equal"])

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def _finish(self, key, future, reward: float | None = None, error: Exception | None = None):
        with self._lock:
            del self._in_flight[key]
            if reward is not None and self._cache_size:
                self._cache[key] = reward
                if len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(reward)


def _done(value: float) -> concurrent.futures.Future:
    future = concurrent.futures.Future()
    future.set_result(value)
    return future
