"""VerifierPool: same rewards as in-process scoring, hard kill of hung calls, cache, recovery.

The pool is created after JAX has run in this process, as in the trainer: its workers must be
spawned, never forked from a multithreaded JAX process.
"""

import json
import os
import pathlib
import signal
import time

import jax.numpy as jnp
import multiprocess
import pytest

from rstar2_jax.rewards import VerifierPool, score

TIMEOUT_S = 2.0
# math-verify issue #65: sympy evaluates 5^(5^3125) in C and no in-process timeout stops it.
HANGING = ("<answer>\\boxed{5^{5^{5^{5}}}}</answer>", "5")
CORPUS_PATH = pathlib.Path(__file__).parent / "data" / "verifier_corpus.jsonl"
CORPUS = [json.loads(line) for line in CORPUS_PATH.read_text().splitlines()]


@pytest.fixture(scope="module")
def pool_and_others():
    """The shared pool, and the pids of processes that were already children before it."""
    jnp.arange(4).sum().block_until_ready()  # JAX's runtime threads are up before the pool
    others = {child.pid for child in multiprocess.active_children()}
    with VerifierPool(num_workers=2, timeout_s=TIMEOUT_S) as pool:
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


def test_hanging_verification_is_killed_scored_zero_and_pool_recovers(pool):
    before = pool.stats()
    start = time.perf_counter()
    assert pool.submit(*HANGING).result() == 0.0
    assert time.perf_counter() - start < 2 * TIMEOUT_S
    after = pool.stats()
    assert after.timeouts == before.timeouts + 1
    # Every call after the kill still works, including ones landing on the replacement worker.
    fresh = [(f"\\boxed{{\\frac{{{2 * n}}}{{2}}}}", str(n)) for n in range(1000, 1008)]
    assert pool.score_batch(fresh) == [1.0] * len(fresh)
    assert _wait_until(lambda: pool.stats().respawns == before.respawns + 1, timeout_s=60)
    # The hung pair is cached as 0 rather than re-run (and re-killed) for every rollout.
    start = time.perf_counter()
    assert pool.submit(*HANGING).result() == 0.0
    assert time.perf_counter() - start < 0.5


def test_grpo_group_costs_one_verification_per_distinct_answer(pool):
    gold = "\\frac{7}{3}"
    answers = ["\\frac{14}{6}", "2.33", "7/3", "\\frac{14}{6}"] * 4  # 16 rollouts, 3 distinct
    before = pool.stats()
    futures = [pool.submit(f"<answer>\\boxed{{{answer}}}</answer>", gold) for answer in answers]
    assert [future.result() for future in futures] == [1.0, 0.0, 1.0, 1.0] * 4
    after = pool.stats()
    assert after.calls - before.calls == 16
    assert after.verified - before.verified == 3
    assert after.cache_hits - before.cache_hits == 13


def test_response_without_boxed_answer_scores_zero_without_a_worker(pool):
    before = pool.stats()
    assert pool.submit("The answer is 12.", "12").result() == 0.0
    after = pool.stats()
    assert after.no_answer == before.no_answer + 1 and after.verified == before.verified


def test_worker_killed_while_idle_is_replaced_before_it_loses_a_call(pool_and_others):
    pool, others = pool_and_others
    before = pool.stats()
    victims = [child for child in multiprocess.active_children() if child.pid not in others]
    assert len(victims) == 2
    os.kill(victims[0].pid, signal.SIGKILL)
    assert _wait_until(lambda: not victims[0].is_alive(), timeout_s=10)
    calls = [(f"\\boxed{{{n}}}", str(n)) for n in range(2000, 2006)]
    assert pool.score_batch(calls) == [1.0] * len(calls)
    assert pool.stats().respawns == before.respawns + 1


def test_closed_pool_stops_its_workers_and_refuses_work():
    others = {child.pid for child in multiprocess.active_children()}
    pool = VerifierPool(num_workers=1, timeout_s=TIMEOUT_S)
    workers = [child for child in multiprocess.active_children() if child.pid not in others]
    assert len(workers) == 1
    assert pool.score_batch([("\\boxed{2}", "2")]) == [1.0]
    pool.close()
    assert not any(worker.is_alive() for worker in workers)
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit("\\boxed{2}", "2")


@pytest.mark.parametrize("kwargs", [{"num_workers": 0}, {"timeout_s": 0.0}, {"cache_size": -1}])
def test_bad_configuration_is_rejected(kwargs):
    with pytest.raises(ValueError):
        VerifierPool(**kwargs)
