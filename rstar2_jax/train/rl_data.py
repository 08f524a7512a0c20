"""From scored rollouts to a training batch: equal-reward filter, RoC, advantages, padding.

Host-side glue between the sampler's `Trajectory` records and the pure functions of
`rstar2_jax.algorithms`; nothing here touches the model.
"""
from __future__ import annotations

import dataclasses
from typing import Literal, Sequence

import jax
import numpy as np

from rstar2_jax.algorithms import (
    group_advantages,
    nonuniform_group_mask,
    penalty_terms,
    roc_select_batch,
)
from rstar2_jax.sampler import Trajectory

# "none" is plain GRPO on all sampled rollouts (the paper's baseline), for comparison.
SelectionRule = Literal["paper", "released", "none"]


@dataclasses.dataclass(frozen=True)
class Selection:
    """Which rollouts train, and their advantages.

    kept: `[num_kept]` indices into the step's trajectories (ordered by question, then sample).
    advantages: `[num_kept]` float32, one per kept rollout.
    groups_kept: questions whose rewards were not all equal.
    """

    kept: np.ndarray
    advantages: np.ndarray
    groups_kept: int


def penalties_of(trajs: Sequence[Trajectory]) -> tuple[np.ndarray, np.ndarray]:
    """RoC penalty terms (p_err, p_format) of each trajectory, `[len(trajs)]` each."""
    stats = np.array([[t.num_tool_calls, t.num_tool_errors, t.num_answer_blocks,
                       max(t.num_turns, 1)] for t in trajs], np.int32).reshape(-1, 4)
    return tuple(np.asarray(term) for term in penalty_terms(*stats.T))


def select_rollouts(key: jax.Array, rewards: np.ndarray, trajs: Sequence[Trajectory],
                    group_size: int, rule: SelectionRule = "paper") -> Selection:
    """Equal-reward filter, then RoC down to `group_size` per question, then GRPO advantages.

    Args:
      key: PRNG key for the "paper" rule's sampling.
      rewards: `[questions, n]` binary rewards; trajectory `q * n + i` is question q's i-th.
      trajs: the `questions * n` trajectories.
      group_size: G, rollouts kept per question (ignored by rule "none", which keeps all n).
      rule: "paper" / "released" RoC (see `roc_select`), or "none" for plain GRPO.
    """
    questions, n = rewards.shape
    if len(trajs) != questions * n:
        raise ValueError(f"{len(trajs)} trajectories for {questions} x {n} rewards")
    keep = np.flatnonzero(np.asarray(nonuniform_group_mask(rewards)))
    if keep.size == 0:
        return Selection(np.zeros((0,), np.int64), np.zeros((0,), np.float32), 0)
    if rule == "none":
        local = np.tile(np.arange(n), (keep.size, 1))
    else:
        penalties = sum(penalties_of(trajs)).reshape(questions, n)
        local = np.asarray(roc_select_batch(key, rewards[keep], penalties[keep], group_size, rule))
    kept_rewards = np.take_along_axis(rewards[keep], local, axis=1)
    advantages = np.asarray(group_advantages(kept_rewards), np.float32)
    kept = (keep[:, None] * n + local).reshape(-1)
    return Selection(kept, advantages.reshape(-1), int(keep.size))


def make_batch(trajs: Sequence[Trajectory], selection: Selection, *, pad_id: int,
               length_multiple: int = 64) -> dict[str, np.ndarray]:
    """Right-padded training arrays for the kept rollouts.

    Each row is prompt + response. The row count is padded up to a power of two and the length
    up to a multiple of `length_multiple`, so the jitted update compiles for few shapes. Padding
    rows carry no loss token (they add nothing to the loss sums); they attend to themselves,
    because a row with no visible token at all would give NaN logits, and NaN * 0 is still NaN
    in the backward pass.

    Returns `[rows, seq]` arrays: tokens, attention_mask, loss_mask (1 on model-generated
    tokens), sampler_logp (the sampler's log-prob of each token, 0 elsewhere), and
    `[rows]` advantages.
    """
    chosen = [trajs[i] for i in selection.kept]
    rows = 1 << max(len(chosen) - 1, 0).bit_length()
    longest = max((len(t.prompt_ids) + len(t.response_ids) for t in chosen), default=1)
    seq = -(-longest // length_multiple) * length_multiple
    batch = {"tokens": np.full((rows, seq), pad_id, np.int32),
             "attention_mask": np.zeros((rows, seq), np.int32),
             "loss_mask": np.zeros((rows, seq), np.int32),
             "sampler_logp": np.zeros((rows, seq), np.float32),
             "advantages": np.zeros((rows,), np.float32)}
    for row, (t, adv) in enumerate(zip(chosen, selection.advantages)):
        p, end = len(t.prompt_ids), len(t.prompt_ids) + len(t.response_ids)
        batch["tokens"][row, :end] = t.prompt_ids + t.response_ids
        batch["attention_mask"][row, :end] = 1
        batch["loss_mask"][row, p:end] = t.loss_mask
        batch["sampler_logp"][row, p:end] = t.logprobs
        batch["advantages"][row] = adv
    batch["attention_mask"][len(chosen):] = 1
    return batch


def rollout_metrics(trajs: Sequence[Trajectory], rewards: np.ndarray,
                    selection: Selection) -> dict[str, float]:
    """Per-step statistics of the sampled and the kept rollouts (paper Fig. 4 and §4.3 curves)."""
    flat = rewards.reshape(-1)
    calls = np.array([t.num_tool_calls for t in trajs])
    errors = np.array([t.num_tool_errors for t in trajs])
    lengths = np.array([len(t.response_ids) for t in trajs])
    p_err, p_format = penalties_of(trajs)
    kept_pos = [i for i in selection.kept if flat[i] == 1]
    all_pos = np.flatnonzero(flat == 1)

    def error_ratio(indices) -> float:
        # Failed calls / calls over a set of rollouts (the paper's "tool-call error ratio").
        total = calls[indices].sum() if len(indices) else 0
        return float(errors[indices].sum() / total) if total else 0.0

    return {
        "reward/mean": float(flat.mean()),
        "reward/question_accuracy": float(rewards.max(axis=1).mean()),  # solved at least once
        "groups/total": float(rewards.shape[0]),
        "groups/kept": float(selection.groups_kept),
        "groups/all_correct": float((rewards.min(axis=1) == 1).mean()),
        "rollouts/kept": float(len(selection.kept)),
        # The error ratios below are 0 when there is no positive; these counts tell the cases apart.
        "rollouts/positives": float(len(all_pos)),
        "rollouts/kept_positives": float(len(kept_pos)),
        "tools/calls_per_rollout": float(calls.mean()),
        "tools/error_ratio": error_ratio(np.arange(len(trajs))),
        "tools/error_ratio_positives": error_ratio(all_pos),
        "tools/error_ratio_kept_positives": error_ratio(np.asarray(kept_pos, np.int64)),
        "tools/rollouts_with_error": float((errors > 0).mean()),
        "roc/penalty_mean": float((p_err + p_format).mean()),
        "roc/p_err_mean": float(p_err.mean()),
        "roc/format_penalty_mean": float(p_format.mean()),
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "response/turns_mean": float(np.mean([t.num_turns for t in trajs])),
        "response/truncated": float(np.mean([t.truncated for t in trajs])),
    }
