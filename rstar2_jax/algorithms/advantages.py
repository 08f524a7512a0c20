"""Advantage estimators (`Algorithm.advantages`): GRPO, Dr. GRPO, RLOO, REINFORCE++-baseline, GPG.

rStar2-Agent §2.2 (docs/algorithms.md): for the G rollouts kept for one question,

    A_i = (r_i - mean(r)) / (std(r) + eps)

and every loss token of rollout i gets A_i. A group whose rewards are all equal has no relative
signal (every A_i would be 0/0 before eps): selections drop such groups first
(`nonuniform_group_mask`), and `group_advantages` returns exact zeros for them should one slip
through.
"""
from typing import Literal

import jax
import jax.numpy as jnp

from rstar2_jax.algorithms.algorithm import Rollouts
from rstar2_jax.algorithms.selection import nonuniform_group_mask

# Sample std (ddof=1) is the default because it is what the paper's trainer used: verl's GRPO
# advantage calls torch.std, which is unbiased, with eps 1e-6; Tunix does the same.
_DDOF = {"sample": 1, "population": 0}


def _centred(rewards: jnp.ndarray) -> jnp.ndarray:
    """``r - mean(r)`` per group ``[groups, m]``, exactly 0 in groups of equal rewards."""
    rewards = jnp.asarray(rewards)
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [num_groups, G], got shape {rewards.shape}")
    rewards = rewards.astype(jnp.result_type(rewards.dtype, jnp.float32))
    centred = rewards - jnp.mean(rewards, axis=-1, keepdims=True)
    # Tested on the raw rewards, not on the centred values: the mean of equal floats can differ
    # from them by one rounding step, which would leave a tiny nonzero advantage.
    return jnp.where(nonuniform_group_mask(rewards)[:, None], centred, 0.0)


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
    centred = _centred(rewards)
    scale = jnp.std(rewards, axis=-1, ddof=_DDOF[std], keepdims=True) + eps
    return jnp.where(centred == 0, 0.0, centred / scale)  # 0, not 0/0, in equal groups at eps=0


def grpo_advantages(kept: Rollouts) -> jnp.ndarray:
    """GRPO's estimator (Shao et al. 2024, DeepSeekMath §4.1.2, outcome supervision):
    A_i = (r_i - mean(r)) / (std(r) + 1e-6) over each `[groups, G]` row, sample std."""
    return group_advantages(kept.rewards)


def dr_grpo_advantages(kept: Rollouts) -> jnp.ndarray:
    """Dr. GRPO's estimator (Liu et al. 2025, "Understanding R1-Zero-Like Training", §3.1):
    A_i = r_i - mean(r), without GRPO's division by std(r), which up-weights questions that are
    nearly always or nearly never solved."""
    return _centred(kept.rewards)


def rloo_advantages(kept: Rollouts) -> jnp.ndarray:
    """RLOO's estimator (Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style
    Optimization for Learning from Human Feedback in LLMs", arXiv 2402.14740): each reward
    minus the mean of the other m - 1 rewards of its group,

        A_i = r_i - 1/(m-1) * sum_{j != i} r_j  =  m/(m-1) * (r_i - mean(r)).

    verl's ``compute_rloo_outcome_advantage`` is the same. Groups of equal rewards give 0.
    Needs m >= 2."""
    rewards = jnp.asarray(kept.rewards)
    m = rewards.shape[-1]
    if m < 2:
        raise ValueError(f"RLOO needs groups of at least 2 rollouts, got {m}")
    return _centred(rewards) * (m / (m - 1))


def reinforce_pp_baseline_advantages(kept: Rollouts) -> jnp.ndarray:
    """REINFORCE++-baseline's estimator (Hu et al. 2025, "REINFORCE++", arXiv 2501.03262: the
    group-mean baseline followed by global batch normalisation):

        c_i = r_i - mean over i's group of r
        A_i = (c_i - mu) / sqrt(var + 1e-8)

    with ``mu`` and ``var`` the mean and the unbiased variance of c over every **loss token** of
    the step (rollout i counts ``kept.lengths[i]`` times), as verl's
    ``compute_reinforce_plus_plus_baseline_outcome_advantage`` whitens its token matrix (and the
    authors' OpenRLHF their token-level advantages). Long rollouts therefore weigh more in the
    statistics; groups of equal rewards have c = 0 but still enter them, and get A = -mu / std.

    Args:
      kept: `[groups, m]` rollouts; uses ``rewards`` and ``lengths`` (loss tokens, >= 0).

    Returns:
      `[groups, m]` float32. Raises ValueError when the step has fewer than 2 loss tokens (no
      variance to estimate, as in verl).
    """
    centred = _centred(kept.rewards)
    tokens = jnp.asarray(kept.lengths, jnp.float32)
    total = float(jnp.sum(tokens))
    if total < 2:
        raise ValueError(f"REINFORCE++-baseline whitens over the step's loss tokens and needs at "
                         f"least 2, got {total:g}")
    mean = jnp.sum(tokens * centred) / total
    var = jnp.sum(tokens * (centred - mean) ** 2) / (total - 1)
    return (centred - mean) * jax.lax.rsqrt(var + 1e-8)


def gpg_advantages(kept: Rollouts) -> jnp.ndarray:
    """GPG's estimator (Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning
    Baseline for Model Reasoning", arXiv 2504.02546; its objective with F_norm = 1):

        A_i = alpha * (r_i - mean over i's group of r),     alpha = B / (B - M)

    over the B rollouts of the step, M of which are in groups of equal rewards (zero advantage,
    "invalid" samples): alpha scales the gradient back up for the share of the batch that
    carries none (the paper's accurate gradient estimation), so GPG's selection keeps every
    group (`keep_every_group`). alpha = 1 when every group is invalid.

    verl's ``compute_gpg_outcome_advantage`` sets alpha = B / (rollouts whose *reward* is not
    0) instead, which is not the paper's M when rewards are 0/1; this follows the paper.
    """
    centred = _centred(kept.rewards)
    rollouts = centred.size
    valid = int(jnp.sum(nonuniform_group_mask(jnp.asarray(kept.rewards)))) * centred.shape[-1]
    return centred * (rollouts / valid if valid else 1.0)
