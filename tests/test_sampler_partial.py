"""Partial rollouts: new weights reach a rollout in flight (`AgentSampler.update_weights`).

A tiny random Qwen3 at temperature 1 checks what each token's version and log-prob are when an
update lands at a fixed decode call (the `AtCall` seam, not a clock): under ``keep`` a token
sampled after the update has the log-prob of the new weights over a prefix cached under the old
ones; under ``recompute`` that of a fresh forward of the new weights over its whole context. The
scripted policy checks that a tool call in flight across an update runs once and lands.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import threading

import jax
import numpy as np
import pytest

from rstar2_jax import chat
from rstar2_jax.model import ModelConfig, forward, forward_cached, init_cache, init_params
from rstar2_jax.sampler import AgentSampler, RolloutLimits, RolloutSettings, SamplingParams
from rstar2_jax.sampler.engine import STAGE_ROWS, bucket
from rstar2_jax.sampler.memory import GIB, plan_memory
from rstar2_jax.sampler.rollout import Trajectory
from rstar2_jax.sampler.weights import WeightUpdates
from rstar2_jax.sandbox import ExecResult
from rstar2_jax.toy import TOY_FORMAT
from rstar2_jax.toy.tokenizer import build_tokenizer
from scripted_policy import make_policy, prompts_for

QUESTIONS = ["What is 1 + 2?", "What is 7 + 3? Think.", "What is 2 + 9? Think. Think. Think."]
SAMPLES = 2
# Log-probs by the engine (paged cache, decode steps) against a plain forward: float32 rounding.
TOL = 5e-6


class NoTools:
    def submit(self, code, stdin=""):
        raise AssertionError("a tool call ran")


@pytest.fixture(scope="module")
def model():
    tokenizer = build_tokenizer([TOY_FORMAT.prompt_text(q) for q in QUESTIONS] * 5, vocab_size=300)
    config = ModelConfig(model_type="qwen3", vocab_size=len(tokenizer), hidden_size=32,
                         intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=8, qk_norm=True)
    prompts = [tokenizer.encode(TOY_FORMAT.prompt_text(q), add_special_tokens=False)
               for q in QUESTIONS]
    weights = [init_params(config, jax.random.key(i)) for i in range(3)]
    return tokenizer, config, prompts, weights


# The prompts have 94-100 tokens.
LIMITS = RolloutLimits(max_turns=1, max_response_tokens=24, max_prompt_tokens=100)


def least_budget_gib(model, rows, limits):
    """A memory budget that leaves the engine its smallest pool."""
    _, config, _, weights = model
    plan = plan_memory(config, weights[0], num_slots=rows, num_rows=rows,
                       max_len=limits.max_prompt_tokens + limits.max_response_tokens,
                       max_prompt_len=limits.max_prompt_tokens, stage_rows=STAGE_ROWS,
                       page_size=RolloutSettings().page_size, budget=None)
    return (plan.fixed() + plan.least_pages * plan.page_bytes) / GIB


def make_sampler(model, on_weight_update="keep", rows=6, memory_budget_gib=None, limits=LIMITS):
    tokenizer, config, _, _ = model
    settings = RolloutSettings(num_slots=rows, num_rows=rows, chunk=4, show_tool_time=False,
                               on_weight_update=on_weight_update,
                               memory_budget_gib=memory_budget_gib)
    return AgentSampler(config, tokenizer, NoTools(), settings, limits,
                        SamplingParams(temperature=1.0), fmt=TOY_FORMAT)


class AtCall(WeightUpdates):
    """Posts ``updates[n]`` (params, version) just before decode call n (1-based) takes the
    mailbox, and notes which prompts were staged then (their pages hold the old weights' KV)."""

    def __init__(self, sampler, updates: dict[int, tuple]):
        super().__init__()
        self.sampler, self.updates, self.calls = sampler, updates, 0
        self.staged_at: dict[int, set[tuple[int, ...]]] = {}

    def take(self, newer_than):
        self.calls += 1
        if self.calls in self.updates:
            self.post(*self.updates[self.calls])
            self.staged_at[self.calls] = {tuple(s.tokens) for s in self.sampler._engine.staged}
        return super().take(newer_than)


def roll(model, updates=None, on_weight_update="keep", rows=6, version=0,
         memory_budget_gib=None, samples=SAMPLES, limits=LIMITS):
    """(trajectories, stats, the seam) of the model's prompts with ``updates`` at fixed calls."""
    sampler = make_sampler(model, on_weight_update, rows, memory_budget_gib, limits)
    seam = sampler.weight_updates = AtCall(sampler, updates or {})
    trajs, stats = sampler.rollout(model[3][0], model[2], samples, seed=5, version=version)
    # A preempted row is recomputed: only the test that shrinks the pool expects any.
    assert (stats.preemptions > 0) == (memory_budget_gib is not None)
    return trajs, stats, seam


def logprobs(config, context, first, prefix_params, prefix, params):
    """log-probs of ``context[first:]`` when its first ``prefix`` tokens are in the cache,
    computed under ``prefix_params``, and the rest under ``params`` (each token is predicted
    from those before it). ``prefix = 0``: a plain forward of ``params``."""
    context = np.asarray(context, np.int32)
    if prefix == 0:
        logits = forward(params, config, context[None, :-1])[0]
    else:
        cache = init_cache(config, 1, bucket(len(context)))
        _, cache = forward_cached(prefix_params, config, context[None, :prefix], cache)
        logits, _ = forward_cached(params, config, context[None, prefix:-1], cache)
        logits = np.concatenate([np.zeros((prefix, logits.shape[-1]), np.float32), logits[0]])
    logp = jax.nn.log_softmax(logits[first - 1:], axis=-1)
    return np.take_along_axis(np.asarray(logp), context[first:, None], axis=1)[:, 0]


def split(traj: Trajectory, version: int) -> int:
    """The number of leading tokens of version ``version``; checks the versions are those
    tokens, then only later versions, non-decreasing."""
    v = np.asarray(traj.versions)
    assert len(v) == len(traj.response_ids) and np.all(np.diff(v) >= 0) and v.min() >= version
    return int(np.sum(v == version))


def test_without_an_update_nothing_changes_and_every_token_has_the_start_version(model):
    plain, stats, _ = roll(model, version=3)
    assert stats.weight_updates == 0
    assert all(t.versions == [3] * len(t.response_ids) for t in plain)
    # The same weights served again at call 3 (keep): bit-identical tokens and log-probs.
    again, stats, _ = roll(model, {3: (model[3][0], 4)}, version=3)
    assert stats.weight_updates == 1
    for a, b in zip(plain, again):
        assert (a.response_ids, a.logprobs, a.loss_mask) == \
            (b.response_ids, b.logprobs, b.loss_mask)
    assert 8 in {split(t, 3) for t in again}  # 2 calls of 4 tokens, then version 4
    # Recomputed under the same weights: the same log-probs up to rounding.
    recomputed, _, _ = roll(model, {3: (model[3][0], 4)}, "recompute", version=3)
    for a, b in zip(plain, recomputed):
        assert a.response_ids == b.response_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=TOL, rtol=0)
    # A trajectory's record carries its versions.
    assert Trajectory.from_record(again[0].record()) == again[0]


@pytest.mark.parametrize("mode", ["keep", "recompute"])
def test_tokens_after_an_update_have_its_version_and_its_log_probs(model, mode):
    _, config, prompts, (old, new, _) = model
    plain, _, _ = roll(model)
    trajs, stats, seam = roll(model, {3: (new, 1)}, mode)
    assert stats.weight_updates == 1
    split_any = False
    for traj, before in zip(trajs, plain):
        prompt, response = traj.prompt_ids, traj.response_ids
        k = split(traj, 0)
        assert traj.versions == [0] * k + [1] * (len(response) - k)
        # Tokens sampled before the update are the ones no update gives, bit for bit.
        assert (response[:k], traj.logprobs[:k]) == (before.response_ids[:k], before.logprobs[:k])
        context, p = prompt + response, len(prompt)
        np.testing.assert_allclose(traj.logprobs[:k],
                                   logprobs(config, context, p, None, 0, old)[:k], atol=TOL, rtol=0)
        if k == len(response):
            continue
        split_any = split_any or k > 0
        fresh = logprobs(config, context, p, None, 0, new)[k:]
        if mode == "recompute":
            np.testing.assert_allclose(traj.logprobs[k:], fresh, atol=TOL, rtol=0)
            continue
        # keep: what the row had cached at the update stays the old weights' (the prompt's
        # staged pages, for a row that started after the update).
        if k:
            prefix = p + k - 1
        else:
            prefix = p - 1 if tuple(prompt[:-1]) in seam.staged_at[3] else 0
        mixed = logprobs(config, context, p, old, prefix, new)[k:]
        np.testing.assert_allclose(traj.logprobs[k:], mixed, atol=TOL, rtol=0)
        assert prefix == 0 or np.abs(mixed - fresh).max() > 1e-3  # the check tells them apart
    assert split_any


def test_rows_started_after_an_update_use_the_staged_prompts_right(model):
    """With 3 rows, later samples start after the update from prompts staged before it."""
    _, config, _, (old, new, _) = model
    for mode in ("keep", "recompute"):
        trajs, _, seam = roll(model, {2: (new, 1)}, mode, rows=3)
        late = [t for t in trajs if split(t, 0) == 0]
        staged = [t for t in late if tuple(t.prompt_ids[:-1]) in seam.staged_at[2]]
        assert staged, "no sample started from a prompt staged before the update"
        for t in late:
            context, p = t.prompt_ids + t.response_ids, len(t.prompt_ids)
            prefix = p - 1 if mode == "keep" and t in staged else 0
            np.testing.assert_allclose(t.logprobs, logprobs(config, context, p, old, prefix, new),
                                       atol=TOL, rtol=0)


@pytest.mark.parametrize("preempting", [False, True])
def test_several_updates_and_stale_posts(model, preempting):
    """Recompute: every token's log-prob is its version's over its whole context, also when
    the pool preempts rows (they are prefilled again under the weights current then: 24 rows
    growing to 160 tokens outgrow the smallest pool)."""
    _, config, _, weights = model
    rows, samples, limits, budget = 6, SAMPLES, LIMITS, None
    if preempting:
        rows, samples = 24, 8
        limits = dataclasses.replace(LIMITS, max_response_tokens=60)
        budget = least_budget_gib(model, rows, limits)
    # Call 2 serves version 1; call 4 is posted a stale version 1 (ignored); call 5 version 2.
    trajs, stats, _ = roll(model, {2: (weights[1], 1), 4: (weights[0], 1), 5: (weights[2], 2)},
                           "recompute", rows=rows, samples=samples, memory_budget_gib=budget,
                           limits=limits)
    assert stats.weight_updates == 2
    seen = set()
    for t in trajs:
        split(t, 0)
        context, p = t.prompt_ids + t.response_ids, len(t.prompt_ids)
        for version in set(t.versions):
            at = np.asarray(t.versions) == version
            want = logprobs(config, context, p, None, 0, weights[version])[at]
            np.testing.assert_allclose(np.asarray(t.logprobs)[at], want, atol=TOL, rtol=0)
            seen.add(version)
    assert seen == {0, 1, 2}


def test_settings_reject_an_unknown_mode():
    with pytest.raises(ValueError, match="rollout.on_weight_update must be finish, keep or recompute"):
        RolloutSettings(on_weight_update="drop")


# -- a tool call in flight across an update (the scripted policy) -------------------------------

SCRIPT = [chat.format_tool_call("print(6*7)"), "<answer>\\boxed{42}</answer>"]
THINKER = ["Let me think about it. " * 12 + "<answer>\\boxed{1}</answer>"]


class HeldCalls:
    """An executor whose calls complete only when released (``release``), with ``42``; counts
    the calls submitted."""

    def __init__(self):
        self.submitted, self.held = [], []

    def submit(self, code, stdin=""):
        self.submitted.append(code)
        future = concurrent.futures.Future()
        self.held.append(future)
        return future

    def release(self):
        for future in self.held:
            future.set_result(ExecResult(status="ok", stdout="42\n"))
        self.held = []


class WhileACallIsHeld(WeightUpdates):
    """Posts ``update`` before the first decode call at which a tool call is in flight, then
    lets the call complete: its result lands after the update."""

    def __init__(self, executor, update):
        super().__init__()
        self.executor, self.update, self.posted_at, self.calls = executor, update, None, 0

    def take(self, newer_than):
        self.calls += 1
        if self.posted_at is None and self.executor.held:
            self.post(*self.update)
            self.posted_at = self.calls
            self.executor.release()
        return super().take(newer_than)


def scripted(tokenizer, executor, mode):
    config, params, forward_fn, markers = make_policy(tokenizer, [SCRIPT, THINKER])
    settings = RolloutSettings(num_slots=2, chunk=8, show_tool_time=False, on_weight_update=mode)
    sampler = AgentSampler(config, tokenizer, executor, settings,
                           RolloutLimits(max_turns=4, max_response_tokens=400,
                                         max_prompt_tokens=64),
                           SamplingParams(temperature=0.0), forward_fn=forward_fn)
    return sampler, params, prompts_for(tokenizer, markers, [0, 1])


@pytest.fixture(scope="module")
def tokenizer():
    from scripted_policy import FORMAT

    corpus = ["Let me think about it. print(6*7) answer boxed", FORMAT.prompt_text("q")]
    return build_tokenizer(corpus * 20, vocab_size=400)


class Immediate:
    def submit(self, code, stdin=""):
        future = concurrent.futures.Future()
        future.set_result(ExecResult(status="ok", stdout="42\n"))
        return future


@pytest.mark.parametrize("mode", ["keep", "recompute"])
def test_a_tool_call_in_flight_across_an_update_runs_once_and_lands(tokenizer, mode):
    sampler, params, prompts = scripted(tokenizer, Immediate(), mode)
    (want_caller, want_thinker), _ = sampler.rollout(params, prompts)

    executor = HeldCalls()
    sampler, params, prompts = scripted(tokenizer, executor, mode)
    seam = sampler.weight_updates = WhileACallIsHeld(executor, (dict(params), 1))
    (caller, thinker), stats = sampler.rollout(params, prompts)
    assert seam.posted_at is not None and stats.weight_updates == 1
    assert executor.submitted == ["print(6*7)"]  # once: not lost, not run again
    for got, want in ((caller, want_caller), (thinker, want_thinker)):
        # The recomputed context holds the tool's tokens: the script goes on as without update.
        fields = ("response_ids", "loss_mask", "logprobs", "tool_calls", "finish_reason")
        assert [getattr(got, f) for f in fields] == [getattr(want, f) for f in fields]
    turn_end = caller.turn_spans[0][1]
    # The call's turn was sampled before the update; its result landed after it.
    assert caller.versions == [0] * turn_end + [1] * (len(caller.response_ids) - turn_end)
    assert caller.tool_calls[0].status == "ok" and "42" in caller.tool_calls[0].response_text
    assert 0 < split(thinker, 0) < len(thinker.response_ids)
    if mode == "recompute":
        assert sampler._engine.recomputed_rows == 2  # the paused row and the thinking one


def test_update_weights_from_another_thread_while_the_only_row_waits_on_its_tool(tokenizer):
    """The trainer's thread posts, then the call completes: the next decode call, which resumes
    the row, serves the new version (the row could not decode before the result landed)."""
    sampler, params, prompts = scripted(tokenizer, None, "recompute")

    class PostsThenAnswers:
        def __init__(self):
            self.calls = 0

        def submit(self, code, stdin=""):
            self.calls += 1
            future = concurrent.futures.Future()

            def trainer():
                sampler.update_weights(dict(params), 7)
                future.set_result(ExecResult(status="ok", stdout="42\n"))

            threading.Thread(target=trainer).start()
            return future

    sampler.executor = executor = PostsThenAnswers()
    (caller,), stats = sampler.rollout(params, prompts[:1])
    assert executor.calls == 1 and stats.weight_updates == 1
    tool_end = caller.turn_spans[1][0]
    assert caller.versions == [0] * tool_end + [7] * (len(caller.response_ids) - tool_end)
    assert caller.finish_reason == "answer" and "\\boxed{42}" in caller.response_text
