"""Advantage estimators (`Algorithm.advantages`): group-relative advantages of GRPO and Dr. GRPO.

rStar2-Agent §2.2 (docs/algorithms.md): for the G rollouts kept for one question,

    A_i = (r_i - mean(r)) / (std(r) + eps)

and every loss token of rollout i gets A_i. A group whose rewards are all equal has no relative
signal (every A_i would be 0/0 before eps): selections drop such groups first
(`nonuniform_group_mask`), and `group_advantages` returns exact zeros for them should one slip
through.
"""
from typing import Literal

import jax.numpy as jnp

from rstar2_jax.algorithms.algorithm import Rollouts
from rstar2_jax.algorithms.selection import nonuniform_group_mask

# Sample std (ddof=1) is the default because it is what the paper's trainer used: verl's GRPO
# advantage calls torch.std, which is unbiased, with eps 1e-6; Tunix does the same.
_DDOF = {"sample": 1, "population": 0}


def group_advantages(
    rewards: jnp.ndarray,
    eps: float = 1e-6,
    std: Literal["sample", "population"] = "sample",
) -> jnp.ndarray:
    """GRPO advantages, normalised within each group.

    Args:
      rewards: `[num_groups, G]` rewards of the G rollouts kept for each question.
      eps: added to the std in the denominator (reward units).
      std: "sample" divides the variance by G - 1 (unbiased, as torch.std in the paper's
        code), "population" by G.

    Returns:
      `[num_groups, G]` float advantages, `(r - mean) / (std + eps)` per group; exactly 0 for
      every rollout of a group whose rewards are all equal.
    """
    if std not in _DDOF:
        raise ValueError(f"std must be 'sample' or 'population', got {std!r}")
    rewards = jnp.asarray(rewards)
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [num_groups, G], got shape {rewards.shape}")
    group_size = rewards.shape[-1]
    if group_size <= _DDOF[std]:
        raise ValueError(f"a {std} std needs groups of at least {_DDOF[std] + 1}, got G={group_size}")
    rewards = rewards.astype(jnp.result_type(rewards.dtype, jnp.float32))
    centred = rewards - jnp.mean(rewards, axis=-1, keepdims=True)
    scale = jnp.std(rewards, axis=-1, ddof=_DDOF[std], keepdims=True) + eps
    # Tested on the raw rewards, not on std == 0: the mean of equal floats can differ from them
    # by one rounding step, which would leave a tiny nonzero advantage.
    uniform = ~nonuniform_group_mask(rewards)[:, None]
    return jnp.where(uniform, 0.0, centred / scale)


def grpo_advantages(kept: Rollouts) -> jnp.ndarray:
    """GRPO's estimator (Shao et al. 2024, DeepSeekMath §4.1.2, outcome supervision):
    A_i = (r_i - mean(r)) / (std(r) + 1e-6) over each `[groups, G]` row, sample std."""
    return group_advantages(kept.rewards)


def dr_grpo_advantages(kept: Rollouts) -> jnp.ndarray:
    """Dr. GRPO's estimator (Liu et al. 2025, "Understanding R1-Zero-Like Training", §3.1):
    A_i = r_i - mean(r), without GRPO's division by std(r), which up-weights questions that are
    nearly always or nearly never solved."""
    rewards = jnp.asarray(kept.rewards, jnp.float32)
    return rewards - jnp.mean(rewards, axis=-1, keepdims=True)
