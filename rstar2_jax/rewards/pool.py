"""Score rollouts in killable worker processes, with a cache for repeated answers.

`VerifierPool` is how the trainer computes the outcome reward. Verification is trusted code on
untrusted strings, so workers are persistent (no per-call fork) but disposable: some answers
make sympy grind on huge integers in C code (math-verify issue #65, e.g. `5^{5^{5^{5}}}`), which
no in-process timeout can interrupt. The parent therefore watches every call; when one outlives
`timeout_s` it SIGKILLs the worker, scores the call 0 and spawns a replacement.

All reading of a response happens in a worker, under that watch: `submit` only queues the text
and returns a future. A parent thread per worker sends the response to its worker, which finds
the final answer's boxes (`extract_boxes`) and sends them back; the thread looks the pair
(boxes, gold) up in the cache and, only if it is new, has the worker verify it
(`answer_matches`). A GRPO group of 16-32 rollouts usually repeats a handful of answers, so a
group costs a few verifications, and a pair already being verified by another worker is shared
rather than verified twice.

Workers are started by the forkserver method of `multiprocess`: the trainer has already
started JAX's threads and must never be forked, but the fork server is a fresh interpreter of
its own, started once per process, that has imported and run the checking code
(`rstar2_jax.rewards.warm`) before it forks each worker. A worker (a pool's first, a
replacement for one killed at its deadline, those of the next pool) then starts in a fraction
of a second; spawned, each one imported sympy and math-verify for seconds. Requests and replies
are JSON bytes over a pipe, never pickles.
"""

import collections
import concurrent.futures
import dataclasses
import json
import logging
import math
import os
import queue
import resource
import signal
import threading

import multiprocess

logger = logging.getLogger(__name__)

# A verification that needs more memory than this is pathological; fail it fast (score 0)
# rather than let it swap the host.
_WORKER_MEMORY_BYTES = 4 << 30
# Spawning a worker imports sympy and math-verify: seconds on an idle machine, minutes on a
# loaded one (a job at nice 19 beside a dozen others took more than two). A worker that has not
# died is waited for, however long, since a deadline that load can reach fails a sound run; the
# log says so every `_STARTUP_WARN_S`. One that dies closes its pipe, which ends the wait.
_STARTUP_WARN_S = 120.0
_READY = b"ready"
# `_call`'s outcome when the worker missed the deadline or died: scored 0 but not cached, since a
# deadline missed under load says nothing about the answer.
_LOST = "lost"


def _serve(connection) -> None:
    """Worker main loop. Requests are JSON: `{"response": text}` is answered with the final
    answer's boxes `{"boxes": [...]}`, `{"boxes": [...], "gold": gold}` with `{"equal": bool}`;
    an unexpected failure with `{"error": str}`."""
    # A terminal's Ctrl-C reaches the whole process group: the trainer handles it and stops
    # the pool; a worker must not die on it with a traceback of its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_AS, (_WORKER_MEMORY_BYTES, _WORKER_MEMORY_BYTES))
    import rstar2_jax.rewards.warm  # noqa: F401  already imported where the fork server preloaded it
    from rstar2_jax.rewards.extract import extract_boxes
    from rstar2_jax.rewards.verify import answer_matches

    connection.send_bytes(_READY)
    while True:
        try:
            request = json.loads(connection.recv_bytes())
        except EOFError:  # the pool closed the pipe: shut down
            return
        try:
            if "response" in request:
                reply = {"boxes": list(extract_boxes(request["response"]))}
            else:
                reply = {"equal": answer_matches(request["boxes"], request["gold"])}
        except Exception as error:  # scored 0 by the parent; reported, never fatal
            reply = {"error": f"{type(error).__name__}: {error}"}
        connection.send_bytes(json.dumps(reply).encode())


def _worker_context():
    """`multiprocess`'s forkserver context, its server preloading the checking code. The preload
    list is the process's, read when the server starts (at the first worker): a server started
    earlier by other code without it forks workers that import the checking code themselves,
    as slowly as spawned ones, and as correctly."""
    context = multiprocess.get_context("forkserver")
    context.set_forkserver_preload(["rstar2_jax.rewards.warm"])
    return context


class _Worker:
    """One verifier worker process and the parent's end of its pipe."""

    def __init__(self, context):
        self.connection, child_end = context.Pipe(duplex=True)
        self.process = context.Process(target=_serve, args=(child_end,), daemon=True)
        self.process.start()
        child_end.close()
        died, waited = False, 0.0
        try:
            while not self.connection.poll(_STARTUP_WARN_S):
                waited += _STARTUP_WARN_S
                logger.warning("verifier worker (pid %s) has not started after %.0f s; still waiting "
                               "(the machine may be loaded)", self.process.pid, waited)
            ready = self.connection.recv_bytes() == _READY
        except EOFError:  # the worker closed its end: it is exiting, most often seconds in
            ready, died = False, True
        if not ready:
            self.kill()
            if died:
                raise RuntimeError(
                    f"verifier worker exited (exit code {self.process.exitcode}) before it started, "
                    "its traceback above; most often the script that starts the VerifierPool (or a "
                    "RolloutRuntime) lacks an `if __name__ == '__main__':` guard around it, which it "
                    "needs because each worker imports the main module")
            raise RuntimeError("verifier worker sent something other than its ready message")

    def call(self, request: dict, timeout_s: float) -> dict | str:
        """The worker's reply, or `"timeout"` / `"died"` if it missed the deadline or crashed."""
        try:
            self.connection.send_bytes(json.dumps(request).encode())
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
    """Counters since the pool started. `calls` counts submissions. A worker reads each one;
    it is then answered without verification (no boxed answer: `no_answer`), by the cache
    (`cache_hits`, including pairs already being verified) or by a verification (`verified`).
    `timeouts` counts worker calls (reading or verifying) killed at the deadline, `errors`
    those that failed or crashed; either scores 0. `respawns` counts replacement workers."""

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

    The scoring rule is `rstar2_jax.rewards.score`'s. Reading a response and verifying its
    answer are two worker calls; either taking longer than `timeout_s` seconds of wall time
    scores 0.0 (that worker is killed and replaced). `num_workers` defaults to min(4, CPUs).
    Thread-safe; `cache_size` bounds the (boxes, gold) -> reward memo (LRU). A call whose
    worker could not be started gets that error as its future's exception; every submitted
    call gets exactly one outcome.

    Each worker imports the main module, as a spawned process would: a script that creates a
    pool needs the usual `if __name__ == "__main__":` guard (notebooks and pytest need nothing).

    Futures are resolved, and so their done-callbacks run, on the pool's threads: a callback
    may `submit` or `close`, but `score_batch` there could wait for its own thread and raises
    RuntimeError.
    """

    def __init__(
        self, num_workers: int | None = None, timeout_s: float = 4.0, cache_size: int = 1 << 16
    ):
        if num_workers is None:
            num_workers = min(4, os.cpu_count() or 1)
        if num_workers < 1 or not (0 < timeout_s < math.inf) or cache_size < 0:
            raise ValueError(
                f"need num_workers >= 1, a finite timeout_s > 0, cache_size >= 0; got "
                f"{num_workers}, {timeout_s}, {cache_size}"
            )
        self.timeout_s = timeout_s
        self._cache_size = cache_size
        self._context = _worker_context()
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[tuple, float] = collections.OrderedDict()
        self._in_flight: dict[tuple, concurrent.futures.Future] = {}
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
        """The reward of one response as a future float (0.0 or 1.0).

        Only queues the call: the response is read in a worker, so no text, however long or
        malformed, can hold up the caller.
        """
        future = concurrent.futures.Future()
        with self._lock:  # queued under the lock, so never behind close()'s stop signals
            if self._closed:
                raise RuntimeError("VerifierPool is closed")
            self._counts["calls"] += 1
            self._jobs.put((response_text, gold, future))
        return future

    def score_batch(self, items: list[tuple[str, str]]) -> list[float]:
        """Rewards of `(response_text, gold)` pairs, in order."""
        if threading.current_thread() in self._threads:
            raise RuntimeError("score_batch() from a done-callback of this pool's futures could wait for the "
                               "thread that runs the callback; use submit() there")
        futures = [self.submit(response_text, gold) for response_text, gold in items]
        return [future.result() for future in futures]

    def stats(self) -> VerifierStats:
        with self._lock:
            names = [field.name for field in dataclasses.fields(VerifierStats)]
            return VerifierStats(**{name: self._counts[name] for name in names})

    def close(self) -> None:
        """Finish the calls already submitted, then stop the workers. From a done-callback, the
        calls queued behind the callback's own thread finish after the callback returns."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for _ in self._threads:
                self._jobs.put(None)
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join()

    def __enter__(self) -> "VerifierPool":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _drive(self, slot: int) -> None:
        """Thread body: score jobs with worker `slot` one at a time, replacing it when it fails."""
        while (job := self._jobs.get()) is not None:
            response_text, gold, future = job
            try:
                self._score(slot, response_text, gold, future)
            except Exception as error:  # e.g. no replacement worker: the caller must hear of it
                future.set_exception(error)
            if self._workers[slot] is None and not self._closed:
                # Respawn now, after delivering the result, so the next job does not wait;
                # a failure here is retried (and reported) by the next job.
                try:
                    self._worker(slot)
                except Exception:
                    logger.exception("could not replace verifier worker %d", slot)
        if self._workers[slot] is not None:  # every job is done: the pool is closing
            self._workers[slot].stop()

    def _score(self, slot: int, response_text: str, gold: str, future) -> None:
        """Read the response, then answer `future` from the cache or by verifying."""
        what = f"a response of {len(response_text)} characters"
        reply = self._call(slot, {"response": response_text}, what)
        boxes = tuple(reply["boxes"]) if isinstance(reply, dict) else ()
        if isinstance(reply, dict) and not boxes:
            self._count("no_answer")
        if not boxes:
            future.set_result(0.0)
            return
        key = (boxes, gold)
        with self._lock:
            if key in self._cache:
                self._counts["cache_hits"] += 1
                self._cache.move_to_end(key)
                future.set_result(self._cache[key])
                return
            if key in self._in_flight:
                self._counts["cache_hits"] += 1
                _chain(self._in_flight[key], future)
                return
            self._in_flight[key] = future
        try:
            what = f"{boxes!r:.80} vs {gold!r:.80}"
            reply = self._call(slot, {"boxes": boxes, "gold": gold}, what)
        except Exception as error:
            self._finish(key, future, error=error)
            return
        self._count("verified")
        reward = float(reply["equal"]) if isinstance(reply, dict) else 0.0
        self._finish(key, future, reward=reward, cache=reply is not _LOST)

    def _call(self, slot: int, request: dict, what: str) -> dict | str | None:
        """Worker `slot`'s reply to `request`; `_LOST` (logged) if it timed out or died, None
        (logged) if it failed."""
        worker = self._worker(slot)
        reply = worker.call(request, self.timeout_s)
        if isinstance(reply, str):
            worker.kill()
            self._workers[slot] = None
            self._count("timeouts" if reply == "timeout" else "errors")
            logger.warning("verifier worker %s on %s; scored 0, not cached", reply, what)
            return _LOST
        if "error" in reply:
            self._count("errors")
            logger.warning("verifier error on %s: %s; scored 0", what, reply["error"])
            return None
        return reply

    def _worker(self, slot: int) -> _Worker:
        """The live worker of `slot`, replacing one that is missing or died while idle."""
        if self._workers[slot] is not None and not self._workers[slot].process.is_alive():
            self._workers[slot].kill()
            self._workers[slot] = None
        if self._workers[slot] is None:
            self._workers[slot] = _Worker(self._context)
            self._count("respawns")
        return self._workers[slot]

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def _finish(self, key, future, reward: float | None = None, error: Exception | None = None,
                cache: bool = True):
        with self._lock:
            del self._in_flight[key]
            if reward is not None and cache and self._cache_size:
                self._cache[key] = reward
                if len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(reward)


def _chain(source: concurrent.futures.Future, target: concurrent.futures.Future) -> None:
    """Give `target` the outcome of `source` once it has one."""

    def copy(done: concurrent.futures.Future) -> None:
        if done.exception() is not None:
            target.set_exception(done.exception())
        else:
            target.set_result(done.result())

    source.add_done_callback(copy)
