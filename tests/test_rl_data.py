"""From trajectories to the algorithm's arrays and back: per-rollout counts, the checks on what
an algorithm returns, and the step's rollout metrics (missing, never 0, when undefined)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstar2_jax.algorithms import ALGORITHMS, DAPO, GRPO, GRPO_ROC, Algorithm, Rollouts, Selection, policy_loss
from rstar2_jax.compile_cache import CompileCounter
from rstar2_jax.errors import ConfigError
from rstar2_jax.sampler.rollout import ToolCallRecord, Trajectory
from rstar2_jax.sandbox import ExecResult, render_result
from rstar2_jax.rl.data import (
    KeptRollouts,
    check_algorithm,
    check_trained_ids,
    make_batch,
    rollout_arrays,
    rollout_metrics,
    select_rollouts,
    tool_status_counts,
    tool_status_metrics,
)

TIMEOUT = render_result(ExecResult("timeout", wall_s=4.0))
TRACEBACK = render_result(ExecResult("error", stderr="Traceback ...\nNameError: name 'x' is not defined",
                                     exit_code=1))
PRINTS_ERROR = render_result(ExecResult("ok", stdout="relative error 0.01"))
CLEAN = render_result(ExecResult("ok", stdout="42"))


def call(status, text, turn=0):
    return ToolCallRecord(code="print(42)", stdin="", status=status, response_text=text, turn=turn)


def trajectory(calls=(), answer="<answer>\\boxed{42}</answer>", tokens=6, finish="answer"):
    """A trajectory with one model turn per call plus a final answer turn."""
    turns = [f"<tool_call>...</tool_call><|im_end|>" for _ in calls] + [f"done {answer}<|im_end|>"]
    spans = [(2 * i, 2 * i + 1) for i in range(len(turns))]
    return Trajectory(prompt_index=0, sample_index=0, prompt_ids=[1, 2, 3],
                      response_ids=list(range(4, 4 + tokens)), loss_mask=[1] * (tokens - 1) + [0],
                      logprobs=[-0.5] * tokens, turn_spans=spans, turn_texts=turns,
                      tool_calls=[call(s, t, i) for i, (s, t) in enumerate(calls)],
                      num_answer_blocks=answer.count("</answer>"), finish_reason=finish)


def test_rollout_arrays_count_what_each_rule_needs():
    trajs = [trajectory(),
             trajectory([("timeout", TIMEOUT), ("ok", CLEAN)]),
             trajectory([("error", TRACEBACK), ("ok", PRINTS_ERROR)]),
             trajectory(answer="<answer>1</answer><answer>", finish="budget")]
    r = rollout_arrays(trajs, np.array([[1.0, 1.0], [1.0, 0.0]]))
    assert r.rewards.shape == (2, 2) and r.rewards.dtype == np.float32
    np.testing.assert_array_equal(r.tool_calls, [[0, 2], [2, 0]])
    # The paper's errors: failed calls (the timeout, the traceback). The released code's: responses
    # that say "error" (the traceback and the program that printed the word, not the timeout).
    np.testing.assert_array_equal(r.tool_errors, [[0, 1], [1, 0]])
    np.testing.assert_array_equal(r.tool_error_mentions, [[0, 0], [2, 0]])
    np.testing.assert_array_equal(r.answer_blocks, [[1, 1], [1, 1]])
    np.testing.assert_array_equal(r.answer_tags, [[2, 2], [2, 3]])
    np.testing.assert_array_equal(r.turns, [[1, 3], [3, 1]])
    np.testing.assert_array_equal(r.lengths, [[5, 5], [5, 5]])
    np.testing.assert_array_equal(r.truncated, [[False, False], [False, True]])
    with pytest.raises(ValueError, match="3 trajectories for 2 x 2"):
        rollout_arrays(trajs[:3], np.zeros((2, 2)))


def test_selected_rows_are_the_trained_ones_with_their_advantages():
    # DAPO on one mixed group [1, 0, 0, 1] whose rollout 1 is truncated: it is not trained, and
    # the others keep the advantages computed over all four.
    trajs = [trajectory(), trajectory(finish="budget"), trajectory(), trajectory()]
    r = rollout_arrays(trajs, np.array([[1.0, 0.0, 0.0, 1.0]]))
    kept = select_rollouts(DAPO, jax.random.key(0), r, group_size=2)
    np.testing.assert_array_equal(kept.index, [0, 2, 3])
    a = 0.5 / np.sqrt(1 / 3)
    np.testing.assert_allclose(kept.advantages, [a, -a, a], rtol=1e-5)
    assert kept.groups == 1
    batch = make_batch(trajs, kept, pad_id=0, seq_len=20)
    assert batch["tokens"].shape == (4, 20)  # 3 rows padded to a power of two, 9 tokens to 20
    np.testing.assert_allclose(batch["advantages"], [a, -a, a, 0.0], rtol=1e-5)
    assert batch["loss_mask"][3].sum() == 0
    np.testing.assert_array_equal(batch["tokens"][0], [1, 2, 3, *range(4, 10)] + [0] * 11)
    np.testing.assert_array_equal(batch["loss_mask"][0], [0, 0, 0] + [1] * 5 + [0] * 12)
    np.testing.assert_array_equal(batch["attention_mask"][0], [1] * 9 + [0] * 11)
    # The length is the rollout budget's, whatever the step's longest rollout: one shape per
    # row bucket. A rollout over the budget is an error, never cut.
    assert make_batch(trajs, kept, pad_id=0, seq_len=9)["tokens"].shape == (4, 9)
    with pytest.raises(ValueError, match="9 tokens, more than seq_len=8"):
        make_batch(trajs, kept, pad_id=0, seq_len=8)


def test_a_hosts_share_of_the_kept_rollouts_and_a_common_row_count():
    # Two hosts of 2 questions x 2 rollouts each; the selection kept rollouts 1, 2 (host 0) and
    # 5 (host 1). Host 1 trains on its own rollout 1 (global 5), padded to host 0's 2 rows.
    kept = KeptRollouts(np.array([1, 2, 5]), np.array([0.5, -0.5, 1.0], np.float32), groups=2)
    first, second = kept.share(0, 4), kept.share(4, 8)
    np.testing.assert_array_equal(first.index, [1, 2])
    np.testing.assert_array_equal(second.index, [1])
    np.testing.assert_array_equal(second.advantages, [1.0])
    assert second.groups == 2
    trajs = [trajectory() for _ in range(4)]
    batch = make_batch(trajs, second, pad_id=0, seq_len=12, rows=2)
    assert batch["tokens"].shape == (2, 12) and batch["loss_mask"][1].sum() == 0
    np.testing.assert_array_equal(batch["advantages"], [1.0, 0.0])
    with pytest.raises(ValueError, match="rows=1 cannot hold the 2 kept rollouts"):
        make_batch(trajs, first, pad_id=0, seq_len=12, rows=1)


def _with_select(select):
    return dataclasses.replace(GRPO, select=select)


@pytest.mark.parametrize("algorithm, message", [
    (_with_select(lambda k, r, g: Selection(np.array([0, 1]), np.array([True, True]))), r"\[groups, m\]"),
    (_with_select(lambda k, r, g: Selection(np.array([[0, 0]]), np.ones((1, 2), bool))), "twice"),
    (_with_select(lambda k, r, g: Selection(np.array([[0, 9]]), np.ones((1, 2), bool))), "outside"),
    (dataclasses.replace(GRPO, advantages=lambda kept: kept.rewards[:, :1]), "one value per kept"),
    (dataclasses.replace(GRPO, advantages=lambda kept: np.full_like(kept.rewards, np.nan)), "non-finite"),
])
def test_what_an_algorithm_returns_is_checked(algorithm, message):
    r = rollout_arrays([trajectory()] * 4, np.array([[1.0, 0.0, 0.0, 1.0]]))
    with pytest.raises(ValueError, match=message):
        select_rollouts(algorithm, jax.random.key(0), r, group_size=2)


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_a_steps_selection_and_advantages_compile_nothing_whatever_it_keeps(name):
    # Host-side, on numpy: once the step's shape is known (RoC's rule: one program for
    # [questions, n]), steps that keep 1 to 6 groups compile nothing more.
    rng = np.random.default_rng(0)
    rollouts = [Rollouts.from_rewards((rng.random((6, 8)) < p).astype(np.float32), lengths=5,
                                      tool_calls=rng.integers(0, 3, (6, 8)), turns=2)
                for p in (0.05, 0.2, 0.5, 0.8, 0.95, 0.5)]
    jax.clear_caches()  # what earlier tests compiled counts too (loaded from the cache)
    select_rollouts(ALGORITHMS[name], jax.random.key(0), rollouts[-1], group_size=4)
    with CompileCounter() as counter:
        kept = [select_rollouts(ALGORITHMS[name], jax.random.key(i), r, group_size=4).groups
                for i, r in enumerate(rollouts)]
    assert len(set(kept)) >= 3 or set(kept) == {6}, kept  # or it keeps every group
    assert counter.stats.compiled + counter.stats.loaded == 0, counter.stats.programs


def test_check_algorithm_fails_before_any_rollout():
    check_algorithm(GRPO_ROC, rollouts_per_question=8, group_size=4)
    check_algorithm(GRPO, rollouts_per_question=6, group_size=4)  # keeps all: any n
    with pytest.raises(ValueError, match=r"rl\.rollouts_per_question=8 and rl\.group_size=3.*G of the 2G"):
        check_algorithm(GRPO_ROC, rollouts_per_question=8, group_size=3)
    broken = dataclasses.replace(GRPO, loss=lambda logp, old, adv, mask: jnp.sum(logp))
    with pytest.raises(ValueError, match=r"\(loss_sum, count, metric_sums\)"):
        check_algorithm(broken, rollouts_per_question=4, group_size=2)


def per_rollout_only(logp, old, adv, mask):
    """A loss written for [rows] advantages: per-token ones broadcast to [rows, rows, seq]."""
    per_token = jnp.where(mask, -adv[:, None] * logp, 0.0)
    return jnp.sum(per_token), jnp.sum(mask, dtype=jnp.int32), {}


def test_a_rollout_correction_needs_a_loss_that_takes_per_token_advantages():
    for name in ALGORITHMS:
        check_algorithm(ALGORITHMS[name], rollouts_per_question=8, group_size=4, token_advantages=True)
    mine = dataclasses.replace(GRPO, loss=per_rollout_only)
    check_algorithm(mine, rollouts_per_question=4, group_size=2)  # fine without weights
    with pytest.raises(ConfigError, match=r"per-token advantages \[rows, seq\].*loss_sum"):
        check_algorithm(mine, rollouts_per_question=4, group_size=2, token_advantages=True)
    refuses = dataclasses.replace(GRPO, loss=lambda logp, old, adv, mask: (
        policy_loss(logp, old, adv, mask) if adv.ndim == 1 else 1 / 0))
    with pytest.raises(ConfigError, match="ZeroDivisionError"):
        check_algorithm(refuses, rollouts_per_question=4, group_size=2, token_advantages=True)


def test_error_ratios_are_missing_not_zero_when_undefined():
    trajs = [trajectory([("timeout", TIMEOUT), ("ok", CLEAN)]), trajectory([("ok", CLEAN)]),
             trajectory(), trajectory([("error", TRACEBACK)])]
    lengths = np.array([len(t.response_ids) for t in trajs])
    # No positive at all: nothing to measure among positives.
    r = rollout_arrays(trajs, np.zeros((1, 4)))
    empty = select_rollouts(GRPO, jax.random.key(0), r, group_size=2)
    m = rollout_metrics(r, empty, lengths)
    assert "tools/error_ratio_positives" not in m and "tools/error_ratio_kept_positives" not in m
    assert m["tools/error_ratio"] == pytest.approx(2 / 4) and m["rollouts/positives"] == 0
    # Rollouts 0 and 2 correct: 1 failed call of 2 among positives.
    r = rollout_arrays(trajs, np.array([[1.0, 0.0, 1.0, 0.0]]))
    kept = select_rollouts(GRPO, jax.random.key(0), r, group_size=2)
    m = rollout_metrics(r, kept, lengths)
    assert m["tools/error_ratio_positives"] == pytest.approx(0.5)
    assert m["tools/error_ratio_kept_positives"] == pytest.approx(0.5)
    assert (m["rollouts/positives"], m["rollouts/kept_positives"], m["groups/kept"]) == (2, 2, 1)
    # Only the positive without a tool call: no call to take a ratio of.
    r = rollout_arrays(trajs, np.array([[0.0, 0.0, 1.0, 0.0]]))
    m = rollout_metrics(r, select_rollouts(GRPO, jax.random.key(0), r, group_size=2), lengths)
    assert "tools/error_ratio_positives" not in m and m["rollouts/positives"] == 1


def test_tool_calls_are_counted_by_how_they_ended():
    trajs = [trajectory([("timeout", TIMEOUT), ("ok", CLEAN), ("timeout", TIMEOUT)]),
             trajectory([("malformed", "bad call")]), trajectory()]
    counts = tool_status_counts(trajs)
    assert counts.shape[0] == 3 and counts.sum(axis=1).tolist() == [3, 1, 0]
    shares = tool_status_metrics(counts.reshape(1, 3, -1))  # as the step holds them: [q, n, statuses]
    nonzero = {k: v for k, v in shares.items() if v}
    assert nonzero == {"tools/share/timeout": pytest.approx(2 / 4), "tools/share/ok": pytest.approx(1 / 4),
                       "tools/share/malformed": pytest.approx(1 / 4)}
    assert {"tools/share/error", "tools/share/memory", "tools/share/sandbox_error"} <= shares.keys()
    # No call at all: nothing to take a share of.
    assert tool_status_metrics(tool_status_counts([trajectory(), trajectory()])) == {}


def test_advantage_statistics_over_the_kept_rollouts():
    trajs = [trajectory() for _ in range(6)]
    lengths = np.array([len(t.response_ids) for t in trajs])
    r = rollout_arrays(trajs, np.zeros((2, 3)))
    kept = KeptRollouts(np.array([0, 1, 3, 4]), np.array([1.0, -1.0, 0.0, 0.5], np.float32), groups=2)
    m = rollout_metrics(r, kept, lengths)
    assert {k: m[k] for k in m if k.startswith("advantages/")} == {
        "advantages/mean": pytest.approx(0.125), "advantages/abs_mean": pytest.approx(0.625),
        "advantages/min": -1.0, "advantages/max": 1.0, "advantages/nonzero_frac": 0.75}
    nothing = KeptRollouts(np.zeros((0,), np.int64), np.zeros((0,), np.float32), groups=0)
    assert not any(k.startswith("advantages/") for k in rollout_metrics(r, nothing, lengths))


def test_a_custom_algorithm_needs_no_trainer_change():
    # Rewards minus the group's best: a pure function passed by value.
    def below_best(kept):
        return kept.rewards - kept.rewards.max(axis=-1, keepdims=True)

    algorithm = Algorithm(select=GRPO.select, advantages=below_best, loss=GRPO.loss)
    r = rollout_arrays([trajectory()] * 4, np.array([[1.0, 0.0, 0.0, 1.0]]))
    kept = select_rollouts(algorithm, jax.random.key(0), r, group_size=2)
    np.testing.assert_array_equal(kept.advantages, [0.0, -1.0, -1.0, 0.0])


# --- the rows trained on are the ids sampled ---------------------------------------------------

def encode(text):
    """A stand-in tokenizer for tool outputs: the scaffold around one id per character."""
    return [90, *(100 + ord(c) % 50 for c in text), 91]


def agentic(prompt=(1, 2, 3)):
    """Turn 0 (3 sampled ids) calls the tool; its output is shown; turn 1 (2 ids) answers."""
    tool = encode("ok")
    response = [10, 11, 12, *tool, 13, 14]
    end0, start1 = 3, 3 + len(tool)
    return Trajectory(prompt_index=0, sample_index=0, prompt_ids=list(prompt), response_ids=response,
                      loss_mask=[1, 1, 1] + [0] * len(tool) + [1, 1],
                      logprobs=[-0.1, -0.2, -0.3] + [0.0] * len(tool) + [-0.4, -0.5],
                      turn_spans=[(0, end0), (start1, start1 + 2)], turn_texts=["call", "answer"],
                      tool_calls=[call("ok", "ok", turn=0)], finish_reason="answer")


def direct():
    return Trajectory(prompt_index=1, sample_index=0, prompt_ids=[4, 5], response_ids=[20, 21],
                      loss_mask=[1, 1], logprobs=[-0.6, -0.7], turn_spans=[(0, 2)],
                      turn_texts=["answer"], finish_reason="answer")


def checked(trajs, edit_batch=None):
    kept = KeptRollouts(np.arange(len(trajs)), np.ones(len(trajs), np.float32), 1)
    batch = make_batch(trajs, kept, pad_id=0, seq_len=16, rows=4)
    if edit_batch is not None:
        edit_batch(batch)
    check_trained_ids(batch, trajs, kept, encode)


def test_sampled_rows_pass_the_id_check():
    checked([agentic(), direct()])


@pytest.mark.parametrize("corrupt, message", [
    # A tool output token trained on (loss mask 1 inside the tool turn).
    (lambda t: t.loss_mask.__setitem__(4, 1), "loss mask is not 1 exactly on the model's turns"),
    # The tool output the model was shown differs from what the row holds.
    (lambda t: t.response_ids.__setitem__(5, 99), r"\[3, 7\) hold 4 tokens, but the tokens there should be the tool output shown after turn 0"),
    # A turn boundary off by one.
    (lambda t: t.turn_spans.__setitem__(1, (6, 9)), "loss mask"),
    # Two turns with no tool call between them.
    (lambda t: t.tool_calls.clear(), "without a tool call between them"),
    # A sampled token after the last turn.
    (lambda t: (t.response_ids.append(15), t.loss_mask.append(0), t.logprobs.append(0.0)),
     r"\[9, 10\) hold 1 tokens, but the tokens there should be none"),
])
def test_a_trajectory_that_is_not_what_was_sampled_is_refused(corrupt, message):
    t = agentic()
    corrupt(t)
    with pytest.raises(ValueError, match=message):
        checked([direct(), t])


@pytest.mark.parametrize("edit, message", [
    (lambda b: b["tokens"].__setitem__((0, 3 + 2), 0), "tokens are not the sampled prompt and response"),
    (lambda b: b["attention_mask"].__setitem__((0, 15), 1), "followed by padding"),
    (lambda b: b["sampler_logp"].__setitem__((0, slice(3, 13)), np.roll(b["sampler_logp"][0, 3:13], 1)),
     "sampler log-probs"),
    (lambda b: b["loss_mask"].__setitem__((0, 3), 0), "loss mask"),
])
def test_a_batch_row_that_is_not_the_trajectory_is_refused(edit, message):
    with pytest.raises(ValueError, match=message):
        checked([agentic(), direct()], edit)
