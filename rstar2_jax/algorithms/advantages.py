"""Advantage estimators (`Algorithm.advantages`): GRPO, Dr. GRPO, RLOO, REINFORCE++-baseline, GPG.

rStar2-Agent §2.2 (docs/algorithms.md): for the G rollouts kept for one question,

    A_i = (r_i - mean(r)) / (std(r) + eps)

and every loss token of rollout i gets A_i. A group whose rewards are all equal has no relative
signal (every A_i would be 0/0 before eps): selections drop such groups first
(`nonuniform_group_mask`), and `group_advantages` returns exact zeros for them should one slip
through.

The trainer calls them on the host with numpy arrays, and they compute in numpy (nothing to
compile however many groups a step keeps); given jax arrays they compute in `jax.numpy`, and
jit (`rstar2_jax.algorithms._checks.array_namespace`).
"""
import contextlib
from typing import Literal

import jax.numpy as jnp
import numpy as np

from rstar2_jax.algorithms._checks import array_namespace, as_float
from rstar2_jax.algorithms.algorithm import Rollouts
from rstar2_jax.algorithms.selection import nonuniform_group_mask

# Sample std (ddof=1) is the default because it is what the paper's trainer used: verl's GRPO
# advantage calls torch.std, which is unbiased, with eps 1e-6; Tunix does the same.
_DDOF = {"sample": 1, "population": 0}


def _quiet(xp):
    """numpy's warnings off for a division whose 0/0 is replaced (jax has none)."""
    return np.errstate(divide="ignore", invalid="ignore") if xp is np else contextlib.nullcontext()


def _centred(rewards: jnp.ndarray) -> jnp.ndarray:
    """``r - mean(r)`` per group ``[groups, m]``, exactly 0 in groups of equal rewards."""
    xp = array_namespace(rewards)
    rewards = xp.asarray(rewards)
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [num_groups, G], got shape {rewards.shape}")
    rewards = as_float(rewards, xp)
    centred = rewards - xp.mean(rewards, axis=-1, keepdims=True)
    # Tested on the raw rewards, not on the centred values: the mean of equal floats can differ
    # from them by one rounding step, which would leave a tiny nonzero advantage.
    return xp.where(nonuniform_group_mask(rewards)[:, None], centred, rewards.dtype.type(0))


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
    xp = array_namespace(rewards)
    rewards = xp.asarray(rewards)
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [num_groups, G], got shape {rewards.shape}")
    group_size = rewards.shape[-1]
    if group_size <= _DDOF[std]:
        raise ValueError(f"a {std} std needs groups of at least {_DDOF[std] + 1}, got G={group_size}")
    rewards = as_float(rewards, xp)
    centred = _centred(rewards)
    scale = xp.std(rewards, axis=-1, ddof=_DDOF[std], keepdims=True) + rewards.dtype.type(eps)
    with _quiet(xp):  # 0/0 in equal groups at eps=0, replaced by 0
        return xp.where(centred == 0, rewards.dtype.type(0), centred / scale)


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
    m = kept.rewards.shape[-1]
    if m < 2:
        raise ValueError(f"RLOO needs groups of at least 2 rollouts, got {m}")
    centred = _centred(kept.rewards)
    return centred * centred.dtype.type(m / (m - 1))


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
    xp = array_namespace(kept.rewards, kept.lengths)
    centred = _centred(kept.rewards)
    tokens = xp.asarray(kept.lengths).astype(xp.float32)
    total = float(xp.sum(tokens))
    if total < 2:
        raise ValueError(f"REINFORCE++-baseline whitens over the step's loss tokens and needs at "
                         f"least 2, got {total:g}")
    mean = xp.sum(tokens * centred) / xp.float32(total)
    var = xp.sum(tokens * (centred - mean) ** 2) / xp.float32(total - 1)
    return (centred - mean) / xp.sqrt(var + xp.float32(1e-8))


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
    valid = int(nonuniform_group_mask(kept.rewards).sum()) * centred.shape[-1]
    return centred * centred.dtype.type(rollouts / valid if valid else 1.0)
