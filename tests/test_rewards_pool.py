"""VerifierPool: same rewards as in-process scoring, hard kill of hung calls, cache, recovery.

The pool is created after JAX has run in this process, as in the trainer: its workers must never
be forked from a multithreaded JAX process (they come from a fork server, a fresh interpreter).
Calls that must be scored run in a pool whose deadline (PATIENT_TIMEOUT_S) no load on the
machine reaches; only the call that must time out runs in a pool with a short one (TIMEOUT_S).
No test here measures how fast a call runs.
"""

import concurrent.futures
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import jax.numpy as jnp
import multiprocess
import pytest

from rstar2_jax.rewards import VerifierPool, score

TIMEOUT_S = 2.0
PATIENT_TIMEOUT_S = 60.0
# Two forms of one number, (1+sqrt(2))^60000 = (1-sqrt(2))^-60000: they agree numerically, so
# only sympy's proof can accept them, and it expands the power (integers of ~76,000 bits) for
# minutes. No size guard refuses it (huge numbers such as math-verify issue #65's 5^{5^{5^{5}}}
# are refused before sympy sees them, and unequal answers are told apart numerically first).
HANGING = ("<answer>\\boxed{(1+\\sqrt{2})^{60000}}</answer>", "(1-\\sqrt{2})^{-60000}")
REWARD_MODULES = ("extract.py", "verify.py", "normalize.py", "exact.py")
CORPUS_PATH = pathlib.Path(__file__).parent / "data" / "verifier_corpus.jsonl"
CORPUS = [json.loads(line) for line in CORPUS_PATH.read_text().splitlines()]


@pytest.fixture(scope="module")
def pool_and_others():
    """The shared pool, and the pids of processes that were already children before it."""
    jnp.arange(4).sum().block_until_ready()  # JAX's runtime threads are up before the pool
    others = {child.pid for child in multiprocess.active_children()}
    with VerifierPool(num_workers=2, timeout_s=PATIENT_TIMEOUT_S) as pool:
        yield pool, others


@pytest.fixture
def pool(pool_and_others):
    return pool_and_others[0]


def _wait_until(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_pool_scores_the_corpus_like_in_process_scoring(pool):
    rewards = pool.score_batch([(case["response"], case["gold"]) for case in CORPUS])
    assert rewards == [float(case["expected"]) for case in CORPUS]


@pytest.fixture
def short_pool(pool_and_others):
    with VerifierPool(num_workers=1, timeout_s=TIMEOUT_S) as pool:
        yield pool


def test_hanging_verification_is_killed_scored_zero_and_pool_recovers(short_pool):
    pool = short_pool
    before = pool.stats()
    assert pool.submit(*HANGING).result() == 0.0
    after = pool.stats()
    assert after.timeouts == before.timeouts + 1
    # Every call after the kill still works, including ones landing on the replacement worker.
    fresh = [(f"\\boxed{{\\frac{{{2 * n}}}{{2}}}}", str(n)) for n in range(1000, 1008)]
    assert pool.score_batch(fresh) == [1.0] * len(fresh)
    assert _wait_until(lambda: pool.stats().respawns == before.respawns + 1, timeout_s=60)
    # A missed deadline is no verdict (under load, a right answer misses it too): the pair is not
    # cached, and the next rollout with it is verified again.
    missed = pool.stats()
    assert pool.submit(*HANGING).result() == 0.0
    again = pool.stats()
    assert (again.cache_hits, again.verified, again.timeouts) == (missed.cache_hits, missed.verified + 1,
                                                                   missed.timeouts + 1)


def test_grpo_group_costs_one_verification_per_distinct_answer(pool):
    gold = "\\frac{7}{3}"
    answers = ["\\frac{14}{6}", "2.33", "7/3", "\\frac{14}{6}"] * 4  # 16 rollouts, 3 distinct
    before = pool.stats()
    # Every response has its own reasoning: the cache is keyed on the boxes, not the text.
    futures = [
        pool.submit(f"<reason>attempt {i}</reason><answer>\\boxed{{{answer}}}</answer>", gold)
        for i, answer in enumerate(answers)
    ]
    assert [future.result() for future in futures] == [1.0, 0.0, 1.0, 1.0] * 4
    after = pool.stats()
    assert after.calls - before.calls == 16
    assert after.verified - before.verified == 3
    assert after.cache_hits - before.cache_hits == 13


def test_several_boxes_share_one_verification(pool):
    gold = "(31, 3), (97, 1)"  # values no other test scores, so nothing is cached yet
    responses = [
        "<answer>\\boxed{(31, 3)} and \\boxed{(97, 1)}</answer>",
        "<answer>so \\boxed{(31, 3)}, \\boxed{(97, 1)}</answer>",  # the same boxes
        "<answer>\\boxed{(97, 1)} and \\boxed{(31, 3)}</answer>",  # another order: verified
        "<answer>\\boxed{(31, 3)}</answer>",
    ]
    before = pool.stats()
    assert pool.score_batch([(text, gold) for text in responses]) == [1.0, 1.0, 1.0, 0.0]
    assert pool.stats().verified - before.verified == 3
    # Hedging between candidates for a single value scores 0 through the pool too.
    assert pool.submit("<answer>\\boxed{31} or \\boxed{97}</answer>", "97").result() == 0.0


def test_response_without_boxed_answer_scores_zero_without_verification(pool):
    before = pool.stats()
    assert pool.submit("The answer is 12.", "12").result() == 0.0
    after = pool.stats()
    assert after.no_answer == before.no_answer + 1 and after.verified == before.verified


def test_submit_reads_nothing_in_the_callers_thread_and_the_worker_reads_in_time(pool):
    """`'<answer>' + '\\boxed{' * 8000` blocked `submit` ~27 s (quadratic extraction in the
    caller's thread). Now `submit` only queues it: no reward code runs in this thread during
    the call, and a worker reads it (no answer) inside the pool's deadline. Ten times as many
    boxes: quadratic reading would take ~45 min, far past PATIENT_TIMEOUT_S; linear, milliseconds."""
    response = "<answer>" + "\\boxed{" * 80_000
    ran = []

    def record(frame, event, arg):
        if event == "call":
            ran.append(frame.f_code.co_filename)

    before = pool.stats()
    sys.setprofile(record)
    try:
        future = pool.submit(response, "5")
    finally:
        sys.setprofile(None)
    assert isinstance(future, concurrent.futures.Future)
    assert not [name for name in ran if name.endswith(REWARD_MODULES)]
    assert future.result() == 0.0
    after = pool.stats()
    assert after.no_answer == before.no_answer + 1 and after.timeouts == before.timeouts
    # The pool goes on working.
    assert pool.score_batch([(f"\\boxed{{{n}}}", str(n)) for n in range(3000, 3004)]) == [1.0] * 4


def test_any_amount_of_spacing_is_scored_without_a_timeout(pool):
    """`1` + 2,000 spaces + `2` took > 30 s to normalise (a cubic pattern; `\\,` and `\\;` became
    spaces first): in the pool, a timeout and a worker restart per response. 100,000 of them
    would take days; each is read in linear time, well inside the deadline."""
    gap = "\\," * 100_000 + " "
    responses = [(f"<answer>\\boxed{{1{gap}000}}</answer>", "1000"),
                 (f"<answer>\\boxed{{1{gap}and{gap}2}}</answer>", "1, 2"),
                 (f"<answer>\\boxed{{x{gap}={gap}6{gap}={gap}5}}</answer>", "5")]
    before = pool.stats()
    assert pool.score_batch(responses) == [1.0, 1.0, 0.0]
    after = pool.stats()
    assert (after.timeouts, after.errors, after.respawns) == (before.timeouts, before.errors, before.respawns)


def test_any_code_point_crosses_the_pipe(pool):
    """A lone surrogate (a JSON `\\ud800` in model output decodes to one) in the response, the
    boxes or the gold is text like any other."""
    assert pool.submit("<answer>\\boxed{\ud800}</answer>", "5").result() == 0.0
    assert pool.submit("<answer>\\boxed{\ud800}</answer>", "\ud800").result() == 1.0
    assert pool.submit("\ud800\x00<answer>\\boxed{7}</answer>", "7").result() == 1.0


def test_workers_killed_while_idle_are_replaced_before_they_lose_a_call(pool_and_others):
    """Both workers die while idle, so whichever thread takes a call finds its worker dead: each
    call is scored by a replacement, none is lost. (Killing one worker left the test to the
    scheduler: on a loaded machine the other thread could take every call, and nothing was
    replaced.) The victims are reaped before any call, without a deadline."""
    pool, others = pool_and_others
    before = pool.stats()
    victims = [child for child in multiprocess.active_children() if child.pid not in others]
    assert len(victims) == 2
    for victim in victims:
        os.kill(victim.pid, signal.SIGKILL)
        victim.join()
    calls = [(f"\\boxed{{{n}}}", str(n)) for n in range(2000, 2006)]
    assert pool.score_batch(calls) == [1.0] * len(calls)
    after = pool.stats()
    assert (after.timeouts, after.errors) == (before.timeouts, before.errors)
    assert 1 <= after.respawns - before.respawns <= 2


def test_closed_pool_stops_its_workers_and_refuses_work():
    others = {child.pid for child in multiprocess.active_children()}
    pool = VerifierPool(num_workers=1, timeout_s=PATIENT_TIMEOUT_S)
    workers = [child for child in multiprocess.active_children() if child.pid not in others]
    assert len(workers) == 1
    assert pool.score_batch([("\\boxed{2}", "2")]) == [1.0]
    pool.close()
    assert not any(worker.is_alive() for worker in workers)
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit("\\boxed{2}", "2")


def test_done_callbacks_may_submit_and_close_but_not_wait(pool_and_others):
    """Callbacks run on the pool's threads: score_batch() there could wait for its own thread,
    so it says so; submit() works, and close() finishes every call already submitted."""
    others = {child.pid for child in multiprocess.active_children()}
    pool = VerifierPool(num_workers=1, timeout_s=PATIENT_TIMEOUT_S)
    workers = [child for child in multiprocess.active_children() if child.pid not in others]
    gate, held, seen = threading.Event(), threading.Event(), {}

    def hold(_):  # keeps the pool's only thread busy while the futures below get their callbacks
        if threading.current_thread() is not threading.main_thread():
            held.set()
            gate.wait()

    while not held.is_set():  # a future already done runs its callback here: try again
        pool.submit("\\boxed{1}", "1").add_done_callback(hold)
        held.wait(0.1)

    def waits(_):
        try:
            pool.score_batch([("\\boxed{1}", "1")])
        except RuntimeError as error:
            seen["score_batch"] = str(error)

    second = pool.submit("<answer>\\boxed{2}</answer>", "2")
    second.add_done_callback(waits)
    second.add_done_callback(lambda _: seen.setdefault("chained", pool.submit("\\boxed{5}", "5")))
    pool.submit("<answer>\\boxed{3}</answer>", "3").add_done_callback(lambda _: pool.close())
    behind_close = pool.submit("<answer>\\boxed{4}</answer>", "4")
    gate.set()
    assert second.result() == 1.0 and "use submit()" in seen["score_batch"]
    assert behind_close.result() == 1.0 and seen["chained"].result() == 1.0
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit("\\boxed{2}", "2")
    assert _wait_until(lambda: not any(worker.is_alive() for worker in workers), timeout_s=60)


@pytest.mark.parametrize("kwargs", [{"num_workers": 0}, {"timeout_s": 0.0}, {"timeout_s": float("nan")},
                                    {"timeout_s": float("inf")}, {"cache_size": -1}])
def test_bad_configuration_is_rejected(kwargs):
    with pytest.raises(ValueError):
        VerifierPool(**kwargs)


def test_workers_come_from_the_fork_server_not_from_this_process():
    # This process has run JAX (module docstring): a worker it forked or spawned would be its
    # child. The fork server's workers are the server's children, so waiting for one fails.
    with VerifierPool(num_workers=2, timeout_s=PATIENT_TIMEOUT_S) as pool:
        assert pool.score_batch([("<answer>\\boxed{2}</answer>", "2")]) == [1.0]
        for worker in pool._workers:
            with pytest.raises(ChildProcessError):
                os.waitpid(worker.process.pid, os.WNOHANG)


def test_a_script_without_the_main_guard_is_told_it_needs_one(tmp_path):
    # The worker imports the script, whose pool cannot start from a worker: the worker
    # dies at once, and the error must say so, and why, without waiting for the start-up timeout.
    script = tmp_path / "no_guard.py"
    script.write_text("from rstar2_jax.rewards import VerifierPool\n"
                      "with VerifierPool(num_workers=1) as pool:\n"
                      "    print('started')\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path, env=os.environ | {"PYTHONPATH": str(pathlib.Path(__file__).parents[1])})
    assert done.returncode == 1 and "started" not in done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: verifier worker exited (exit code 1) before it started")
    assert "lacks an `if __name__ == '__main__':` guard" in last and "did not start within" not in last


class _SlowStart:
    """A worker's pipe end that stays silent for ``silent`` polls, then says ``then``: ready,
    or dies (its end closed: EOFError); and the process and context around it."""

    pid, exitcode = 4242, 1

    def __init__(self, silent, then):
        self.silent, self.then, self.polls = silent, then, []

    def Pipe(self, duplex):
        return self, self

    def Process(self, **kwargs):
        return self

    def start(self):
        pass

    def poll(self, timeout):
        self.polls.append(timeout)
        return len(self.polls) > self.silent

    def recv_bytes(self):
        if self.then == "died":
            raise EOFError
        return b"ready"

    def close(self):
        pass

    def kill(self):
        pass

    def join(self):
        pass


def test_a_worker_slow_to_start_is_waited_for_while_it_lives(monkeypatch):
    """However long a worker takes to start (minutes on a loaded machine), the pool waits for it,
    warning every `_STARTUP_WARN_S`; a worker that dies while it starts fails at once."""
    from rstar2_jax.rewards import pool as verifier_pool

    warnings = []
    monkeypatch.setattr(verifier_pool.logger, "warning", lambda *args: warnings.append(args))
    slow = _SlowStart(silent=3, then="ready")
    worker = verifier_pool._Worker(slow)
    assert worker.process is slow and slow.polls == [verifier_pool._STARTUP_WARN_S] * 4
    assert [w[1:] for w in warnings] == [(4242, 120.0), (4242, 240.0), (4242, 360.0)]
    assert "has not started after" in warnings[0][0]

    with pytest.raises(RuntimeError, match="exited .* before it started"):
        verifier_pool._Worker(_SlowStart(silent=2, then="died"))
