"""Resample-on-Correct (RoC): keep G of the 2G rollouts sampled for one question.

rStar2-Agent §2.2 (DESIGN.md §3). The 2G rollouts split into positives (reward 1) and negatives
(reward 0). Negatives are kept for diversity, uniformly; positives are kept for quality, preferring
a low penalty

    p_total = p_err + p_format,
    p_err    = erroneous tool calls / tool calls          (0.5 if no tool call),
    p_format = 1 if no answer block, else min(1, (answer blocks - 1) / turns).

Two selection rules, one argument (`mode`):

- "paper" (default), the rule as the paper states it. Negatives: floor(|neg| / 2), uniformly
  without replacement. Positives: the remaining G - floor(|neg| / 2) = ceil(|pos| / 2), without
  replacement, each draw with probability proportional to 1 / p_total among those not yet drawn.
  A zero penalty (the ideal trajectory: no failed call, one answer block) has infinite weight; we
  take the limit p -> 0 of the law: zero-penalty positives are kept before any penalised one,
  uniformly at random among themselves when they outnumber the quota.
- "released", the authors' released code (microsoft/rStar `rstar2_agent/down_sample/roc.py`,
  after fix #50). Deterministic. Quotas proportional to the class sizes, round(|neg| / 2) and
  round(|pos| / 2) with round-half-to-even (Python's `round`), then raised to at least
  min(2, class size) per class, the other class taking the rest. Positives: the lowest penalties,
  ties in rollout order; negatives: the first in rollout order (rollouts are i.i.d., so this is a
  uniform choice). For odd G the two rounded quotas need not sum to G (the released code then
  fails an assertion); we give negatives their rounded quota and positives the rest, which is
  identical to the released code for every even G.

Both rules keep exactly G rollouts for every split, odd class sizes and all-positive or
all-negative groups included (those carry no signal and are normally dropped first by
`nonuniform_group_mask`; RoC then keeps G of the single class).

How tool errors and turns are counted is the caller's job (`roc_penalty` and `penalty_terms`
take counts). The
released code counts differently (substring "error" in a tool response, which misses timeouts;
turns after the first only, research/rstar2.md §1.3); `mode` changes the selection rule only.
"""
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from rstar2_jax.algorithms._checks import check_values

Mode = Literal["paper", "released"]

# The released code's floor on each class's quota (min_{zero,non_zero}_reward_trace_num).
_RELEASED_MIN_PER_CLASS = 2


def penalty_terms(
    num_tool_calls: jnp.ndarray,
    num_tool_errors: jnp.ndarray,
    num_answer_blocks: jnp.ndarray,
    num_turns: jnp.ndarray,
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """The two RoC penalty terms (p_err, p_format) of each rollout, from its statistics.

    All arguments are integer arrays of one (broadcastable) shape, one entry per rollout.

    Args:
      num_tool_calls: tool calls made, malformed ones included.
      num_tool_errors: calls among them that failed: execution error (traceback), timeout or
        malformed call (bad JSON, wrong tool name, missing code).
      num_answer_blocks: closed `<answer>...</answer>` blocks in the response.
      num_turns: assistant turns, the first included (>= 1).

    Returns:
      float32 (p_err, p_format), each in [0, 1], same shape as the broadcast inputs.
    """
    calls, errors, answers, turns = (
        jnp.asarray(x) for x in (num_tool_calls, num_tool_errors, num_answer_blocks, num_turns)
    )
    check_values(calls, lambda c: c >= 0, "num_tool_calls must be >= 0")
    check_values(errors, lambda e: (e >= 0) & (e <= calls), "need 0 <= num_tool_errors <= num_tool_calls")
    check_values(answers, lambda a: a >= 0, "num_answer_blocks must be >= 0")
    check_values(turns, lambda t: t >= 1, "num_turns must be >= 1 (the first turn counts)")
    # The no-call value 0.5 sits between a clean and a fully failed tool user: it rewards trying
    # the tool (paper: "to encourage tool usage").
    p_err = jnp.where(calls > 0, errors / jnp.maximum(calls, 1), 0.5)
    p_format = jnp.where(answers > 0, jnp.minimum(1.0, (answers - 1) / turns), 1.0)
    return p_err.astype(jnp.float32), p_format.astype(jnp.float32)


def roc_penalty(
    num_tool_calls: jnp.ndarray,
    num_tool_errors: jnp.ndarray,
    num_answer_blocks: jnp.ndarray,
    num_turns: jnp.ndarray,
) -> jnp.ndarray:
    """RoC penalty p_err + p_format of each rollout (see `penalty_terms`), float32 in [0, 2]."""
    p_err, p_format = penalty_terms(num_tool_calls, num_tool_errors, num_answer_blocks, num_turns)
    return p_err + p_format


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
      mode: "paper" or "released" (module docstring).

    Returns:
      `[G]` int32 distinct indices into the 2G rollouts, ascending (rollout order).
    """
    rewards, penalties = jnp.asarray(rewards), jnp.asarray(penalties)
    _check_group(rewards, penalties, group_size, mode)
    positive = rewards == 1
    num_neg = jnp.sum(~positive, dtype=jnp.int32)
    if mode == "paper":
        neg_quota = num_neg // 2
        keys = _paper_sort_keys(key, positive, penalties)
    else:
        neg_quota = _released_negative_quota(num_neg, group_size)
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


def _check_group(rewards, penalties, group_size, mode, batched=False):
    if mode not in ("paper", "released"):
        raise ValueError(f"mode must be 'paper' or 'released', got {mode!r}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
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


def _released_negative_quota(num_neg, group_size):
    """Negatives kept by the released rule for `num_neg` negatives out of 2G rollouts."""
    num_pos = 2 * group_size - num_neg
    half = num_neg // 2
    quota = half + (num_neg % 2) * (half % 2)  # round(num_neg / 2), half to even
    neg_floor = jnp.minimum(_RELEASED_MIN_PER_CLASS, num_neg)
    quota = jnp.where(quota <= neg_floor, neg_floor, quota)
    # Applied second, so the positives' floor wins, as in the released code.
    pos_floor = jnp.minimum(_RELEASED_MIN_PER_CLASS, num_pos)
    return jnp.where(group_size - quota <= pos_floor, group_size - pos_floor, quota)


def _rank_within_class(positive, num_neg, keys):
    """Position of each rollout in its class when ordered by `keys` (most significant first),
    ties broken by rollout index: `[2G]` int32, 0 = first to keep."""
    index = jnp.arange(positive.shape[0])
    # lexsort sorts by its last key first: class (negatives first), then `keys`, then index.
    order = jnp.lexsort((index, *reversed(keys), positive))
    rank = jnp.zeros_like(index).at[order].set(index)
    return (rank - jnp.where(positive, num_neg, 0)).astype(jnp.int32)
