"""Resample-on-Correct (RoC): keep G of the 2G rollouts sampled for one question.

rStar2-Agent §2.2 (docs/algorithms.md). The 2G rollouts split into positives (reward 1) and negatives
(reward 0). Negatives are kept for diversity, uniformly; positives are kept for quality, preferring
a low penalty

    p_total = p_err + p_format,
    p_err    = erroneous tool calls / tool calls          (0.5 if no tool call),
    p_format = 1 if no answer block, else min(1, (answer blocks - 1) / turns).

Two variants, "paper" and "released" (the authors' code, microsoft/rStar
`rstar2_agent/down_sample/roc.py` after fix #50). They differ in exactly the three entries of
their `RocRule` in `RULES`, the one place that names the difference:

- how the penalty is counted (`paper_penalty_terms`, `released_penalty_terms`);
- how many negatives are kept (`paper_negative_quota`, `released_negative_quota`);
- how positives are picked: "paper" draws them without replacement, each draw with probability
  proportional to 1 / p_total among those not yet drawn; "released" keeps the lowest penalties,
  ties in rollout order. A zero penalty (the ideal trajectory: no failed call, one answer block)
  has infinite weight under 1 / p; we take the limit p -> 0 of the law: zero-penalty positives
  are kept before any penalised one, uniformly at random among themselves when they outnumber
  the quota.

Negatives are uniform in both: "paper" draws them at random, "released" takes the first in
rollout order (rollouts are i.i.d., so this is a uniform choice). Positives fill the rest of the
G. Whenever the 2G rollouts hold both classes, both rules keep at least one of each (the kept
group always carries a signal); all-positive or all-negative groups (normally dropped first by
the equal-reward filter) keep G of their single class.
"""
from __future__ import annotations

import functools
from typing import Callable, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rstar2_jax.algorithms._checks import array_namespace, as_float, check_values
from rstar2_jax.algorithms.algorithm import Rollouts, Selection, group_index
from rstar2_jax.algorithms.selection import nonuniform_group_mask

Mode = Literal["paper", "released"]

# The released code's floor on each class's quota (min_{zero,non_zero}_reward_trace_num).
_RELEASED_MIN_PER_CLASS = 2


def penalty_terms(
    num_tool_calls: jnp.ndarray,
    num_tool_errors: jnp.ndarray,
    num_answer_blocks: jnp.ndarray,
    num_turns: jnp.ndarray,
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """The paper's two RoC penalty terms (p_err, p_format) of each rollout, from its counts.

    All arguments are integer arrays of one (broadcastable) shape, one entry per rollout.

    Args:
      num_tool_calls: tool calls made, malformed ones included.
      num_tool_errors: calls among them that failed: execution error (traceback), timeout or
        malformed call (bad JSON, wrong tool name, missing code).
      num_answer_blocks: closed `<answer>...</answer>` blocks in the response.
      num_turns: assistant turns, the first included (>= 1).

    Returns:
      float32 (p_err, p_format), each in [0, 1], same shape as the broadcast inputs; numpy for
      host inputs, jax for jax ones (`array_namespace`).
    """
    xp = array_namespace(num_tool_calls, num_tool_errors, num_answer_blocks, num_turns)
    calls, errors, answers, turns = (
        xp.asarray(x) for x in (num_tool_calls, num_tool_errors, num_answer_blocks, num_turns)
    )
    check_values(calls, lambda c: c >= 0, "num_tool_calls must be >= 0")
    check_values(errors, lambda e: (e >= 0) & (e <= calls), "need 0 <= num_tool_errors <= num_tool_calls")
    check_values(answers, lambda a: a >= 0, "num_answer_blocks must be >= 0")
    check_values(turns, lambda t: t >= 1, "num_turns must be >= 1 (the first turn counts)")
    # The no-call value 0.5 sits between a clean and a fully failed tool user: it rewards trying
    # the tool (paper: "to encourage tool usage").
    p_err = xp.where(calls > 0, _ratio(errors, xp.maximum(calls, 1), xp), 0.5)
    p_format = xp.where(answers > 0, xp.minimum(1.0, _ratio(answers - 1, turns, xp)), 1.0)
    return p_err.astype(xp.float32), p_format.astype(xp.float32)


def _ratio(counts, totals, xp):
    """counts / totals in float32, as jax divides integers (numpy would in float64)."""
    return as_float(counts, xp) / as_float(totals, xp)


def roc_penalty(
    num_tool_calls: jnp.ndarray,
    num_tool_errors: jnp.ndarray,
    num_answer_blocks: jnp.ndarray,
    num_turns: jnp.ndarray,
) -> jnp.ndarray:
    """The paper's RoC penalty p_err + p_format of each rollout (`penalty_terms`), float32 in [0, 2]."""
    p_err, p_format = penalty_terms(num_tool_calls, num_tool_errors, num_answer_blocks, num_turns)
    return p_err + p_format


def paper_penalty_terms(rollouts: Rollouts) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(p_err, p_format) as the paper counts them (§2.2): an error is any failed call (execution
    error, timeout, malformed call) and every model turn counts, the first included."""
    r = rollouts
    return penalty_terms(r.tool_calls, r.tool_errors, r.answer_blocks, r.turns)


def released_penalty_terms(rollouts: Rollouts) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(p_err, p_format) as the released code counts them (microsoft/rStar
    `rstar2_agent/down_sample/roc.py`: `calc_error_ratio_penalty_weights`, `calc_format_penalty_weights`).

    - p_err: a tool response is an error when its text contains "error" in any case, so a
      timeout ("reason: timeout") is not one and an output that prints the word is; 0.5 with no
      tool response.
    - p_format: 1 when an answer tag is missing or unpaired (the `<answer>` and `</answer>`
      counts differ from the closed blocks) or when no assistant turn after the first exists;
      else min(1, (blocks - 1) / later turns). The released regex runs on the response text,
      whose first assistant header is part of the prompt, so only turns 2, 3, ... count: a
      correct answer with no tool call gets p_format 1 and p_total 1.5 here, 0.5 in the paper.

    The released regexes read the whole decoded response; here the counts come from the
    trajectory's structure (`Rollouts`), which agrees with them except on text no well-formed
    rollout holds: an answer tag or a `<|im_start|>assistant` printed by a tool (the released
    code counts them, letting a program's output change the format penalty), an answer block
    opened in one turn and closed in a later one (unpaired here), and a truncated last turn
    (counted here; its reward is 0, and negatives' penalties are not used).
    """
    r = rollouts
    p_err, _ = penalty_terms(r.tool_calls, r.tool_error_mentions, r.answer_blocks, r.turns)
    xp = array_namespace(r.answer_blocks, r.turns, r.answer_tags)
    answers, later_turns = xp.asarray(r.answer_blocks), xp.asarray(r.turns) - 1
    unscored = (answers == 0) | (xp.asarray(r.answer_tags) != 2 * answers) | (later_turns == 0)
    p_format = xp.where(unscored, 1.0, xp.minimum(1.0, _ratio(answers - 1, xp.maximum(later_turns, 1), xp)))
    return p_err, p_format.astype(xp.float32)


def paper_negative_quota(num_neg: jnp.ndarray, group_size: int) -> jnp.ndarray:
    """Negatives kept out of 2G by the paper's rule: half, rounded down (floor(|neg| / 2)), so
    the positives get the other half rounded up (ceil(|pos| / 2)) and the two fill G exactly.

    The paper states "half" of each class without a rounding rule. Rounding alone would drop the
    only negative of 2G - 1 positives and 1 negative (floor(1 / 2) = 0), leaving a group of
    equal rewards: no signal, yet its tokens would dilute the token mean. So the quota is then
    raised to 1; whenever both classes are present each keeps at least one rollout (needs G >= 2).
    """
    num_pos = 2 * group_size - num_neg
    return jnp.clip(num_neg // 2, jnp.minimum(num_neg, 1), group_size - jnp.minimum(num_pos, 1))


def released_negative_quota(num_neg: jnp.ndarray, group_size: int) -> jnp.ndarray:
    """Negatives kept out of 2G by the released rule (microsoft/rStar `down_sample/roc.py`, quotas per uid).

    Quotas proportional to the class sizes, round(|neg| / 2) and round(|pos| / 2) with
    round-half-to-even (Python's `round`); a quota at or below min(2, class size) is raised to
    it, the other class taking the rest, negatives first and positives second (the positives'
    floor wins). 31 correct and 1 wrong keeps 1 negative; 30 and 2 keeps 2. For odd G the two
    rounded quotas need not sum to G (the released code then fails an assertion); negatives
    keep their rounded quota and positives take the rest, which is the released result for
    every even G.
    """
    num_pos = 2 * group_size - num_neg
    half = num_neg // 2
    quota = half + (num_neg % 2) * (half % 2)  # round(num_neg / 2), half to even
    neg_floor = jnp.minimum(_RELEASED_MIN_PER_CLASS, num_neg)
    quota = jnp.where(quota <= neg_floor, neg_floor, quota)
    pos_floor = jnp.minimum(_RELEASED_MIN_PER_CLASS, num_pos)
    return jnp.where(group_size - quota <= pos_floor, group_size - pos_floor, quota)


class RocRule(NamedTuple):
    """Everything in which one RoC variant differs from the other."""

    penalty_terms: Callable[[Rollouts], tuple[jnp.ndarray, jnp.ndarray]]
    negative_quota: Callable[[jnp.ndarray, int], jnp.ndarray]
    sample_positives: bool  # True: draw proportional to 1 / penalty; False: lowest first


RULES: dict[str, RocRule] = {
    "paper": RocRule(paper_penalty_terms, paper_negative_quota, sample_positives=True),
    "released": RocRule(released_penalty_terms, released_negative_quota, sample_positives=False),
}


def roc_selection(key: jax.Array, rollouts: Rollouts, group_size: int,
                  mode: Mode = "paper") -> Selection:
    """GRPO-RoC's selection (an `Algorithm.select`): the equal-reward filter, then RoC keeps G
    of each remaining question's 2G rollouts, all of which train.

    Args:
      key: PRNG key for the paper rule's draws.
      rollouts: `[questions, 2G]` rollouts.
      group_size: G.
      mode: "paper" or "released".

    Returns:
      `Selection` with `[kept questions, G]` indices, question order, ascending within a row.
    """
    rewards = np.asarray(rollouts.rewards)
    questions, n = rewards.shape
    if n != 2 * group_size:
        raise ValueError(f"GRPO-RoC keeps G of the 2G rollouts of a question: got {n} rollouts per "
                         f"question for G = {group_size}")
    _check_mode(mode)
    keep = np.flatnonzero(np.asarray(nonuniform_group_mask(rewards)))
    p_err, p_format = RULES[mode].penalty_terms(rollouts)
    penalties = np.asarray(p_err + p_format)
    local = np.zeros((0, group_size), np.int64)
    if keep.size:
        local = _select_kept(key, rewards, penalties, keep, group_size, mode)
    index = group_index(keep, local, n)
    return Selection(index, np.ones(index.shape, bool))


def _select_kept(key, rewards, penalties, keep, group_size, mode) -> np.ndarray:
    """``roc_select_batch(key, rewards[keep], penalties[keep], group_size, mode)``, computed in
    a program of one shape per run, `[questions, 2G]`, instead of one per kept count.

    The kept questions' rows go first, in order, and the dropped ones fill the rest: each kept
    row is drawn with the key ``roc_select_batch`` gives it (its place among the kept), because
    a partitionable threefry split's first k keys are ``split(key, k)``, and the rows of the
    vmapped selection do not depend on each other. Without that split (another PRNG
    implementation, or ``jax_threefry_partitionable`` off) the kept rows alone are selected, a
    program per kept count. Only the kept rows' values are checked, as before.
    """
    rewards, penalties = np.asarray(rewards), np.asarray(penalties)
    if not (jax.config.jax_threefry_partitionable and str(jax.random.key_impl(key)) == "threefry2x32"):
        return np.asarray(roc_select_batch(key, rewards[keep], penalties[keep], group_size, mode))
    rows = np.concatenate([keep, np.setdiff1d(np.arange(rewards.shape[0]), keep)])
    rewards, penalties = rewards[rows], penalties[rows]
    _check_group(rewards[:keep.size], penalties[:keep.size], group_size, mode, batched=True)
    return np.asarray(_split_and_select(key, rewards, penalties, group_size, mode))[:keep.size]


def roc_select(
    key: jax.Array,
    rewards: jnp.ndarray,
    penalties: jnp.ndarray,
    group_size: int,
    mode: Mode = "paper",
) -> jnp.ndarray:
    """Indices of the G rollouts RoC keeps out of the 2G sampled for one question.

    Jit with `static_argnames=("group_size", "mode")`; vmap over questions, or use
    `roc_select_batch`.

    Args:
      key: PRNG key; "released" is deterministic and ignores it.
      rewards: `[2G]` binary outcome rewards (1 correct, 0 not).
      penalties: `[2G]` RoC penalties (`roc_penalty`), finite and >= 0; only the positives' are used.
      group_size: G, the number of rollouts to keep.
      mode: "paper" or "released" (module docstring, `RULES`).

    Returns:
      `[G]` int32 distinct indices into the 2G rollouts, ascending (rollout order).
    """
    rewards, penalties = jnp.asarray(rewards), jnp.asarray(penalties)
    _check_group(rewards, penalties, group_size, mode)
    rule = RULES[mode]
    positive = rewards == 1
    num_neg = jnp.sum(~positive, dtype=jnp.int32)
    neg_quota = rule.negative_quota(num_neg, group_size)
    if rule.sample_positives:
        keys = _paper_sort_keys(key, positive, penalties)
    else:
        keys = (jnp.where(positive, penalties, 0.0),)
    pos_quota = group_size - neg_quota
    rank = _rank_within_class(positive, num_neg, keys)
    keep = jnp.where(positive, rank < pos_quota, rank < neg_quota)
    return jnp.flatnonzero(keep, size=group_size).astype(jnp.int32)


def roc_select_batch(
    key: jax.Array,
    rewards: jnp.ndarray,
    penalties: jnp.ndarray,
    group_size: int,
    mode: Mode = "paper",
) -> jnp.ndarray:
    """`roc_select` for many questions at once, one independent key per question.

    Args:
      key: PRNG key, split into one key per question.
      rewards: `[num_questions, 2G]` binary rewards.
      penalties: `[num_questions, 2G]` RoC penalties.
      group_size: G.
      mode: "paper" or "released".

    Returns:
      `[num_questions, G]` int32 indices into each question's 2G rollouts, ascending per row.
    """
    rewards, penalties = jnp.asarray(rewards), jnp.asarray(penalties)
    if rewards.ndim != 2 or penalties.shape != rewards.shape:
        raise ValueError(
            f"rewards and penalties must both be [num_questions, 2G], got shapes {rewards.shape} and {penalties.shape}"
        )
    # Values are checked here, on concrete arrays, because inside the compiled vmap they are traced.
    _check_group(rewards, penalties, group_size, mode, batched=True)
    keys = jax.random.split(key, rewards.shape[0])
    return _select_many(keys, rewards, penalties, group_size, mode)


_select_many = jax.jit(jax.vmap(roc_select, in_axes=(0, 0, 0, None, None)), static_argnums=(3, 4))


@functools.partial(jax.jit, static_argnums=(3, 4))
def _split_and_select(key, rewards, penalties, group_size, mode):
    """`roc_select_batch` without its checks, one program: the key split in it too."""
    return _select_many(jax.random.split(key, rewards.shape[0]), rewards, penalties, group_size, mode)


def _check_mode(mode):
    if mode not in RULES:
        raise ValueError(f"mode must be one of {', '.join(map(repr, RULES))}, got {mode!r}")


def _check_group(rewards, penalties, group_size, mode, batched=False):
    _check_mode(mode)
    if group_size < 2:
        raise ValueError(f"RoC keeps at least one rollout of each class, so it needs "
                         f"group_size >= 2, got {group_size}")
    if mode == "released" and group_size < 2 * _RELEASED_MIN_PER_CLASS:
        raise ValueError(
            f"the released rule keeps at least {_RELEASED_MIN_PER_CLASS} per class, so it needs "
            f"group_size >= {2 * _RELEASED_MIN_PER_CLASS}, got {group_size}"
        )
    expected = rewards.shape[:-1] + (2 * group_size,) if batched else (2 * group_size,)
    if rewards.shape != expected or penalties.shape != expected:
        raise ValueError(
            f"expected rewards and penalties of shape {expected} (2G rollouts for G={group_size}), "
            f"got {rewards.shape} and {penalties.shape}"
        )
    check_values(rewards, lambda r: (r == 0) | (r == 1), "rewards must be binary (0 or 1)")
    check_values(penalties, lambda p: np.isfinite(p) & (p >= 0), "penalties must be finite and >= 0")


def _paper_sort_keys(key, positive, penalties):
    """Sort keys (most significant first) whose ascending order, within each class, is a draw of
    the paper's rule: uniform for negatives, proportional to 1 / penalty for positives."""
    # Weighted sampling without replacement by Gumbel-top-k: add independent Gumbel(0, 1) noise g_i
    # to the log-weights and keep the largest. Why that is sequential sampling: exp(-(log w_i +
    # g_i)) = exp(-g_i) / w_i is an Exponential clock of rate w_i, so sorting the perturbed
    # log-weights from the top is the order in which independent clocks ring. The first ring is
    # item i with probability w_i / sum(w); clocks are memoryless, so the next ring is again a draw
    # proportional to w among the items left, and so on: the top k are k sequential draws.
    gumbel = jax.random.gumbel(key, penalties.shape)
    penalised = positive & (penalties > 0)
    log_weight = jnp.where(penalised, -jnp.log(jnp.where(penalised, penalties, 1.0)), 0.0)
    # Zero-penalty positives (infinite weight) go first, ordered among themselves by the noise alone.
    return (penalised, -(log_weight + gumbel))


def _rank_within_class(positive, num_neg, keys):
    """Position of each rollout in its class when ordered by `keys` (most significant first),
    ties broken by rollout index: `[2G]` int32, 0 = first to keep."""
    index = jnp.arange(positive.shape[0])
    # lexsort sorts by its last key first: class (negatives first), then `keys`, then index.
    order = jnp.lexsort((index, *reversed(keys), positive))
    rank = jnp.zeros_like(index).at[order].set(index)
    return (rank - jnp.where(positive, num_neg, 0)).astype(jnp.int32)
