"""Agentic rollouts with a scripted policy (`scripted_policy.py`): tool calls, pauses,
resumes, limits, masks. Everything but the policy -- the engine, the host loop, the sandbox, the
chat format -- is the real code.
"""
from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest

from rstar2_jax import chat
from rstar2_jax.sampler import AgentSampler, RolloutLimits, RolloutSettings, SamplingParams
from rstar2_jax.sampler.engine import STAGE_ROWS, bucket
from rstar2_jax.sampler.memory import GIB, plan_memory
from rstar2_jax.sandbox import SandboxPool
from scripted_policy import FORMAT, make_policy, prompts_for


@pytest.fixture(scope="module")
def tokenizer():
    from rstar2_jax.toy.tokenizer import build_tokenizer

    corpus = ["Let me compute this with Python. print(6*7) answer boxed", FORMAT.prompt_text("q")]
    return build_tokenizer(corpus * 20, vocab_size=400)


class _ByIntent:
    """The executor of these tests: the call written to time out runs with a 1 s deadline, every
    other call with one that no load on the machine reaches (the 0.8 s call must succeed)."""

    TIMES_OUT = "time.sleep(30)"

    def __init__(self, short, patient):
        self.short, self.patient = short, patient

    def submit(self, code, stdin=""):
        return (self.short if self.TIMES_OUT in code else self.patient).submit(code, stdin)

    def session(self, seed=None):
        """Sessions run on the patient pool: no script that uses one writes a call to time out."""
        return self.patient.session(seed)


@pytest.fixture(scope="module")
def pool():
    with SandboxPool(num_workers=1, timeout_s=1.0) as short, SandboxPool(num_workers=2, timeout_s=60.0) as patient:
        yield _ByIntent(short, patient)


def call(code: str) -> str:
    return chat.format_tool_call(code)


SCRIPTS = [
    # 0: a call that works, a call that times out, then the answer.
    ["Let me compute." + call("print(6*7)"), call("import time\ntime.sleep(30)"),
     "</reason><answer>\\boxed{42}</answer>"],
    # 1: malformed JSON, a call that raises, then the answer.
    ['<tool_call>{"name": oops</tool_call>', call("print(1/0)"),
     "</reason><answer>\\boxed{7}</answer>"],
    # 2: answers at once.
    ["</reason><answer>\\boxed{3}</answer>"],
    # 3: calls the tool every turn (hits max_turns).
    [call("print(1)")] * 6,
    # 4: a slow call (0.8 s), then the answer.
    [call("import time\ntime.sleep(0.8)\nprint('slow')"), "<answer>\\boxed{1}</answer>"],
    # 5: a fast call, then the answer.
    [call("print(2)"), "<answer>\\boxed{2}</answer>"],
    # 6: talks until the token budget runs out.
    ["blah " * 400],
    # 7: answers after a long think (8x the tokens of script 2).
    ["Let me compute this with Python. " * 20 + "</reason><answer>\\boxed{3}</answer>"],
    # 8-9 use the tool's state (with rollout.tool_session). 8: draws a random number in one call
    # and prints it in the next.
    [call("import random\nr = random.random()\nprint(r)"), call("print(r)"), "<answer>\\boxed{1}</answer>"],
    # 9: counts its own calls, every turn (hits max_turns).
    [call("n = globals().get('n', 0) + 1\nprint(n)")] * 6,
]


def expected_turn_ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False) + [
        tokenizer.convert_tokens_to_ids(chat.IM_END)]


def make_sampler(tokenizer, executor, num_slots=4, settings=None, **limits):
    config, params, forward, markers = make_policy(tokenizer, SCRIPTS)
    settings = RolloutSettings(num_slots=num_slots, show_tool_time=False, chunk=16,
                               **(settings or {}))
    limits = RolloutLimits(**{"max_turns": 4, "max_response_tokens": 600, "max_prompt_tokens": 64,
                              **limits})
    sampler = AgentSampler(config, tokenizer, executor, settings, limits,
                           SamplingParams(temperature=0.0), forward_fn=forward)
    return sampler, params, markers


def run(tokenizer, executor, script_ids, num_slots=4, **limits):
    sampler, params, markers = make_sampler(tokenizer, executor, num_slots, **limits)
    return sampler.rollout(params, prompts_for(tokenizer, markers, script_ids))


def check_layout(tokenizer, traj, script):
    """The response is: turn ids, then tool-response ids, alternating; masks and logps match."""
    pos = 0
    for j, (start, end) in enumerate(traj.turn_spans):
        assert start == pos
        want = expected_turn_ids(tokenizer, script[j])
        assert traj.response_ids[start:end] == want[: end - start]
        assert traj.loss_mask[start:end] == [1] * (end - start)
        assert all(lp > -1e-3 for lp in traj.logprobs[start:end])  # forced tokens: logp ~ 0
        pos = end
        calls = [c for c in traj.tool_calls if c.turn == j]
        if calls:
            tool = chat.encode_tool_response(tokenizer, calls[0].response_text)
            assert traj.response_ids[pos:pos + len(tool)] == tool
            assert traj.loss_mask[pos:pos + len(tool)] == [0] * len(tool)
            assert traj.logprobs[pos:pos + len(tool)] == [0.0] * len(tool)
            pos += len(tool)
    assert pos == len(traj.response_ids) == len(traj.loss_mask) == len(traj.logprobs)


def test_tool_calls_errors_timeouts_and_answers(tokenizer, pool):
    trajs, stats = run(tokenizer, pool, [0, 1, 2, 3])
    assert [(t.prompt_index, t.sample_index) for t in trajs] == [(i, 0) for i in range(4)]
    ok_timeout, malformed_error, direct, looping = trajs

    check_layout(tokenizer, ok_timeout, SCRIPTS[0])
    assert [c.status for c in ok_timeout.tool_calls] == ["ok", "timeout"]
    assert "42" in ok_timeout.tool_calls[0].response_text
    assert ok_timeout.tool_calls[0].code == "print(6*7)"
    assert ok_timeout.finish_reason == "answer" and ok_timeout.num_answer_blocks == 1
    assert ok_timeout.num_tool_errors == 1
    assert "\\boxed{42}" in ok_timeout.response_text
    assert "Tool call" not in ok_timeout.response_text  # tool output is not the model's text

    check_layout(tokenizer, malformed_error, SCRIPTS[1])
    assert [c.status for c in malformed_error.tool_calls] == ["malformed", "error"]
    assert "Tool call failure" in malformed_error.tool_calls[0].response_text
    assert "ZeroDivisionError" in malformed_error.tool_calls[1].response_text
    assert malformed_error.num_tool_errors == 2

    check_layout(tokenizer, direct, SCRIPTS[2])
    assert direct.num_turns == 1 and direct.tool_calls == [] and direct.finish_reason == "answer"

    check_layout(tokenizer, looping, SCRIPTS[3])
    assert looping.finish_reason == "max_turns" and looping.num_turns == 4
    assert looping.num_tool_calls == 3  # the 4th turn's call is not executed
    assert stats.tool_calls == 2 + 2 + 3


def test_budget_ends_the_trajectory_cleanly(tokenizer, pool):
    (talker,), _ = run(tokenizer, pool, [6], max_response_tokens=50)
    assert talker.finish_reason == "budget" and talker.truncated
    assert len(talker.response_ids) == 50 and sum(talker.loss_mask) == 50
    # A tool response that would not fit ends the trajectory before it is appended.
    first_turn = len(expected_turn_ids(tokenizer, SCRIPTS[0][0]))
    (caller,), _ = run(tokenizer, pool, [0], max_response_tokens=first_turn + 3)
    assert caller.finish_reason == "budget" and caller.num_turns == 1
    assert len(caller.response_ids) == first_turn and set(caller.loss_mask) == {1}


class SpyExecutor:
    """Records when each call is submitted and when it completes.

    After ``hold_slow(n)``, the slow call (the one that sleeps) starts only once ``n`` other
    calls have been submitted, or after HOLD_LIMIT_S: the rows it parks must not wait for it, and
    whether they did shows however slowly a loaded machine runs them (a 0.8 s call alone was a
    deadline that load reached)."""

    HOLD_LIMIT_S = 60.0

    def __init__(self, pool):
        self.pool = pool
        self.events = []
        self.lock = threading.Condition()
        self.hold_for = self.others = 0

    def hold_slow(self, others: int) -> None:
        with self.lock:
            self.events.clear()
            self.hold_for, self.others = others, 0

    def submit(self, code, stdin=""):
        with self.lock:
            self.events.append(("submit", code, time.perf_counter()))
        if "sleep" in code and self.hold_for:
            future = concurrent.futures.Future()
            threading.Thread(target=self._start_when_released, args=(code, stdin, future), daemon=True).start()
        else:
            future = self.pool.submit(code, stdin)
            with self.lock:
                self.others += 1
                self.lock.notify_all()
        future.add_done_callback(
            lambda f, code=code: self.events.append(("done", code, time.perf_counter())))
        return future

    def _start_when_released(self, code, stdin, future):
        with self.lock:
            self.lock.wait_for(lambda: self.others >= self.hold_for, timeout=self.HOLD_LIMIT_S)
        future.set_result(self.pool.submit(code, stdin).result())


def test_rows_pause_and_resume_independently_and_slots_refill(tokenizer, pool):
    spy = SpyExecutor(pool)
    sampler, params, markers = make_sampler(tokenizer, spy, num_slots=2)
    sampler.rollout(params, prompts_for(tokenizer, markers, [4, 5, 5]))  # compile everything
    spy.hold_slow(6)
    # Two slots: the slow call parks one row while the six fast trajectories flow through the
    # other slot one after another.
    trajs, stats = sampler.rollout(params, prompts_for(tokenizer, markers, [4] + [5] * 6))
    assert [t.finish_reason for t in trajs] == ["answer"] * 7
    assert "slow" in trajs[0].tool_calls[0].response_text
    slow_done = next(t for kind, code, t in spy.events if kind == "done" and "sleep" in code)
    fast_submits = [t for kind, code, t in spy.events if kind == "submit" and code == "print(2)"]
    assert len(fast_submits) == 6
    assert max(fast_submits) < slow_done, "fast rows waited for the slow row's tool call"
    assert stats.tool_wait_s < stats.wall_s


def test_a_row_waiting_on_its_tool_gives_its_slot_to_another_row(tokenizer, pool):
    """One decode slot, two rows in flight: while the slow call runs, the other row decodes
    the six fast trajectories one after another in the slot the waiting row left."""
    spy = SpyExecutor(pool)
    sampler, params, markers = make_sampler(tokenizer, spy, num_slots=1,
                                            settings=dict(num_rows=2))
    sampler.rollout(params, prompts_for(tokenizer, markers, [4, 5]))  # compile everything
    spy.hold_slow(6)
    trajs, _ = sampler.rollout(params, prompts_for(tokenizer, markers, [4] + [5] * 6))
    assert [t.finish_reason for t in trajs] == ["answer"] * 7
    slow_done = next(t for kind, code, t in spy.events if kind == "done" and "sleep" in code)
    fast_submits = [t for kind, code, t in spy.events if kind == "submit" and code == "print(2)"]
    assert len(fast_submits) == 6 and max(fast_submits) < slow_done
    for t in trajs[1:]:
        check_layout(tokenizer, t, SCRIPTS[5])


def test_samples_of_a_prompt_share_one_prefill(tokenizer, pool):
    sampler, params, markers = make_sampler(tokenizer, pool, num_slots=3)
    prompts = prompts_for(tokenizer, markers, [2, 5])
    trajs, _ = sampler.rollout(params, prompts, samples_per_prompt=4)
    assert [(t.prompt_index, t.sample_index) for t in trajs] == [
        (p, s) for p in range(2) for s in range(4)]
    assert sampler._engine.prompts_prefilled == 2  # one per prompt, 8 samples on 3 slots
    for t in trajs:
        check_layout(tokenizer, t, SCRIPTS[[2, 5][t.prompt_index]])


def test_every_free_slot_is_filled_before_decoding(tokenizer, pool):
    # 12 single-sample prompts on 12 slots: more prompts than one prefill stages (8), yet all
    # rows decode together, so the whole batch takes as many decode calls as one trajectory.
    sampler, params, markers = make_sampler(tokenizer, pool, num_slots=12)
    trajs, _ = sampler.rollout(params, prompts_for(tokenizer, markers, [2] * 12))
    assert sampler._engine.stage_rows < 12
    turn = len(expected_turn_ids(tokenizer, SCRIPTS[2][0]))
    assert sampler._engine.decode_calls == -(-turn // sampler.settings.chunk)
    assert [t.finish_reason for t in trajs] == ["answer"] * 12


def _budget_for_pages(sampler, params, pages):
    """A memory budget (GiB) whose plan gives the engine's pool `pages` pages."""
    settings, limits = sampler.settings, sampler.limits
    plan = plan_memory(sampler.config, params, num_slots=settings.num_slots, num_rows=settings.rows,
                       max_len=limits.max_prompt_tokens + limits.max_response_tokens,
                       max_prompt_len=limits.max_prompt_tokens, stage_rows=STAGE_ROWS,
                       page_size=settings.page_size, budget=None)
    return (plan.fixed() + pages * plan.page_bytes) / GIB


def _tokens(trajs):
    return [(t.response_ids, t.loss_mask, [c.status for c in t.tool_calls], t.finish_reason)
            for t in trajs]


def test_a_long_tail_batch_completes_in_a_pool_a_slots_x_bucket_cache_would_overflow(
        tokenizer, pool):
    """Eight rows, one 8x longer than the others: a cache of slots x (the longest row's
    bucket) would need 2,048 positions; the budget's pool holds a quarter of that, and the batch
    completes with the tokens of an unconstrained run."""
    scripts = [7] + [2] * 7
    limits = dict(max_response_tokens=200, max_prompt_tokens=32)
    free_sampler, params, markers = make_sampler(tokenizer, pool, num_slots=8,
                                                 settings=dict(page_size=8), **limits)
    prompts = prompts_for(tokenizer, markers, scripts)
    unconstrained, _ = free_sampler.rollout(params, prompts)
    sampler, _, _ = make_sampler(tokenizer, pool, num_slots=8, **limits, settings=dict(
        page_size=8, memory_budget_gib=_budget_for_pages(free_sampler, params, 64)))

    trajs, _ = sampler.rollout(params, prompts)

    assert sampler.plan.num_pages == 64 and sampler.plan.fits
    longest = max(len(t.prompt_ids) + len(t.response_ids) for t in trajs)
    shortest = min(len(t.response_ids) for t in trajs)
    assert len(trajs[0].response_ids) >= 8 * shortest
    slots_x_bucket = 8 * bucket(longest, 128)
    assert slots_x_bucket == 2048 and sampler.plan.num_pages * 8 * 4 <= slots_x_bucket
    assert [t.finish_reason for t in trajs] == ["answer"] * 8
    assert _tokens(trajs) == _tokens(unconstrained)


def test_rows_preempted_while_decoding_or_waiting_on_a_tool_finish_the_same(tokenizer, pool):
    """The smallest pool the plan accepts (one row at full length and the staged prompts):
    rows are preempted (with this mix, some while their tool call runs) and recomputed from
    their tokens; every trajectory is the one an unconstrained run gives."""
    scripts = [7, 6, 3, 0, 1, 4, 5, 3]
    limits = dict(max_response_tokens=200, max_prompt_tokens=32)
    free_sampler, params, markers = make_sampler(tokenizer, pool, num_slots=8,
                                                 settings=dict(page_size=8), **limits)
    prompts = prompts_for(tokenizer, markers, scripts)
    unconstrained, _ = free_sampler.rollout(params, prompts)
    least = free_sampler.plan.least_pages
    sampler, _, _ = make_sampler(tokenizer, pool, num_slots=8, **limits, settings=dict(
        page_size=8, memory_budget_gib=_budget_for_pages(free_sampler, params, least)))

    trajs, _ = sampler.rollout(params, prompts)

    assert sampler.plan.num_pages == least < free_sampler.plan.num_pages
    assert sampler._engine.preemptions > 0
    assert _tokens(trajs) == _tokens(unconstrained)


class SessionSpy:
    """A pool whose sessions record the codes they ran and whether they are closed."""

    def __init__(self, pool):
        self.pool = pool
        self.sessions = []

    def submit(self, code, stdin=""):
        raise AssertionError("with tool_session every call goes to a session")

    def session(self, seed=None):
        spy = SessionSpy.Tracked(self.pool.session(seed))
        self.sessions.append(spy)
        return spy

    class Tracked:
        def __init__(self, session):
            self.session, self.codes = session, []

        def submit(self, code, stdin=""):
            self.codes.append(code)
            return self.session.submit(code, stdin)

        def close(self):
            self.session.close()

        @property
        def closed(self):
            return self.session.closed


def _outputs(trajs):
    return [[c.response_text for c in t.tool_calls] for t in trajs]


def test_tool_session_routes_a_trajectorys_calls_to_its_own_session(tokenizer, pool):
    stateless, _ = run(tokenizer, pool, [8])
    assert [c.status for c in stateless[0].tool_calls] == ["ok", "error"]  # r is gone
    sampler, params, markers = make_sampler(tokenizer, pool, settings=dict(tool_session=True))
    prompts = prompts_for(tokenizer, markers, [8, 9, 8, 9])
    trajs, _ = sampler.rollout(params, prompts, seed=3)
    drawn, counted, other, counted_too = trajs
    assert [c.status for c in drawn.tool_calls] == ["ok", "ok"]
    first, second = (c.response_text.split("stdout: ")[1] for c in drawn.tool_calls)
    assert first == second  # the same value, drawn once and read back from the session's state
    assert other.tool_calls[0].response_text != drawn.tool_calls[0].response_text  # its own seed
    for t in (counted, counted_too):  # each counts its own calls only
        assert t.finish_reason == "max_turns"
        assert [c.response_text.split("stdout: ")[1] for c in t.tool_calls] == ["1", "2", "3"]
    again, _ = sampler.rollout(params, prompts, seed=3)
    assert _outputs(again) == _outputs(trajs)  # sessions seeded by the trajectory: reproducible
    assert pool.patient.health()["sessions"] == 0


def test_sessions_close_when_their_trajectory_ends_whatever_ends_it(tokenizer, pool):
    """An answer, the turn limit, a tool response over the budget: each trajectory's session is
    closed by the time it is reported finished; none is left open."""
    closed_at_finish = []
    first_turn = len(expected_turn_ids(tokenizer, SCRIPTS[8][0]))
    for scripts, limits in (([8, 9], {}), ([8], dict(max_response_tokens=first_turn + 3))):
        spy = SessionSpy(pool)

        def on_finish(traj):
            mine = [s for s in spy.sessions if s.codes[0] == traj.tool_calls[0].code]
            closed_at_finish.append((traj.finish_reason, [s.closed for s in mine]))

        sampler, params, markers = make_sampler(tokenizer, spy, settings=dict(tool_session=True),
                                                **limits)
        sampler.rollout(params, prompts_for(tokenizer, markers, scripts), on_finish=on_finish)
        assert len(spy.sessions) == len(scripts)
    assert sorted(closed_at_finish) == [("answer", [True]), ("budget", [True]), ("max_turns", [True])]
    assert pool.patient.health()["sessions"] == 0


def test_sessions_of_preempted_rows_give_the_same_outputs_and_close(tokenizer, pool):
    """The smallest pool: rows are preempted, some while their call runs, and recomputed from
    their tokens. A session holds nothing in the sandbox between calls, so a preempted row costs
    the pool nothing; its calls give the outputs an unconstrained run gives (random draws
    included), and every session is closed at the end."""
    scripts = [7, 9, 8, 5, 9, 4, 8, 3]
    limits = dict(max_response_tokens=400, max_prompt_tokens=32)
    settings = dict(page_size=8, tool_session=True)
    free_sampler, params, markers = make_sampler(tokenizer, pool, num_slots=8, settings=settings,
                                                 **limits)
    prompts = prompts_for(tokenizer, markers, scripts)
    unconstrained, _ = free_sampler.rollout(params, prompts, seed=5)
    spy = SessionSpy(pool)
    sampler, _, _ = make_sampler(tokenizer, spy, num_slots=8, **limits, settings=dict(
        settings, memory_budget_gib=_budget_for_pages(free_sampler, params, free_sampler.plan.least_pages)))

    trajs, _ = sampler.rollout(params, prompts, seed=5)

    assert sampler._engine.preemptions > 0
    assert _tokens(trajs) == _tokens(unconstrained)
    assert _outputs(trajs) == _outputs(unconstrained)
    drawn, read = (c.response_text for c in trajs[2].tool_calls)
    assert drawn == read and "Tool call success" in drawn  # the session's state survived preemption
    assert [c.response_text.split("stdout: ")[1] for c in trajs[1].tool_calls] == ["1", "2"]
    assert all(s.closed for s in spy.sessions) and pool.patient.health()["sessions"] == 0


def test_tool_session_needs_an_executor_with_sessions(tokenizer, pool):
    with pytest.raises(ValueError, match="tool_session"):
        make_sampler(tokenizer, SpyExecutor(pool), settings=dict(tool_session=True))
