"""Selections (`Algorithm.select`) that keep whole groups: every group, the equal-reward filter
and DAPO's overlong filter. RoC, which down-samples each group, is in `rstar2_jax.algorithms.roc`."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from rstar2_jax.algorithms._checks import array_namespace
from rstar2_jax.algorithms.algorithm import Rollouts, SelectFn, Selection, group_index


def nonuniform_group_mask(rewards: jnp.ndarray) -> jnp.ndarray:
    """Which groups have at least two different rewards.

    A group whose rewards are all equal has no relative signal: every group-relative advantage
    is 0, yet its tokens would count in the loss's denominator.

    Args:
      rewards: `[num_groups, n]` rewards of the n rollouts of each question (any n >= 1).

    Returns:
      `[num_groups]` bool, True for groups to keep (rewards not all equal); numpy for host
      inputs, jax for jax ones (`array_namespace`).
    """
    xp = array_namespace(rewards)
    rewards = xp.asarray(rewards)
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [num_groups, n], got shape {rewards.shape}")
    return xp.max(rewards, axis=-1) != xp.min(rewards, axis=-1)


def keep_all(key: jax.Array, rollouts: Rollouts, group_size: int) -> Selection:
    """Every rollout of every question whose rewards are not all equal, all trained.

    The selection of plain GRPO. Dropping equal-reward groups is DAPO's dynamic-sampling filter
    (Yu et al. 2025, §3.2: keep groups with 0 < accuracy < 1) without its re-sampling to refill
    the batch. ``key`` and ``group_size`` are not used: each question's group is all n rollouts.
    """
    rewards = np.asarray(rollouts.rewards)
    return _whole_groups(np.flatnonzero(np.asarray(nonuniform_group_mask(rewards))), rewards.shape[1])


def keep_every_group(key: jax.Array, rollouts: Rollouts, group_size: int) -> Selection:
    """Every rollout of every question, all trained, groups of equal rewards included.

    For estimators whose statistics span the whole step and count the groups that carry no
    signal: GPG's alpha = B / (B - M) and REINFORCE++-baseline's batch whitening (a group of
    equal rewards gets a nonzero advantage there). ``key`` and ``group_size`` are not used."""
    questions, n = np.asarray(rollouts.rewards).shape
    return _whole_groups(np.arange(questions), n)


def _whole_groups(questions: np.ndarray, n: int) -> Selection:
    """All n rollouts of each of ``questions``, one group each, all trained."""
    index = group_index(questions, np.broadcast_to(np.arange(n), (len(questions), n)), n)
    return Selection(index, np.ones(index.shape, bool))


def overlong_filtered(select: SelectFn) -> SelectFn:
    """``select``, then DAPO's overlong filtering (Yu et al. 2025, §3.4: "mask the loss of
    truncated samples"): a truncated rollout keeps its place, and its reward, in its group's
    advantage statistics, but none of its tokens is trained on or counted in the loss."""

    def filtered(key: jax.Array, rollouts: Rollouts, group_size: int) -> Selection:
        selection = select(key, rollouts, group_size)
        truncated = np.asarray(rollouts.take(selection.index).truncated, bool)
        return selection._replace(trains=np.asarray(selection.trains, bool) & ~truncated)

    return filtered
