"""Sequence-level policy losses (`Algorithm.loss`): GSPO and GMPO, one ratio per sequence.

Both take ``(logp, old_logp, advantages, mask)`` like `policy_loss` and return the unreduced
``(loss_sum, count, metric_sums)`` of the loss contract with count = sequences that have a loss
token: the loss is a mean over sequences, its metrics means over sequences (``ratio_max`` a
maximum). Advantages are one per sequence, `[batch]`; per-token advantages `[batch, seq]` (a
rollout correction's weighted ones, `rstar2_jax.algorithms.correction`) enter as their mean over
the sequence's loss tokens. Their ``loss_agg_mode`` has one value, "seq-mean-token-mean": it
declares how they aggregate, so that an entropy bonus or a KL penalty added to them
(`rstar2_jax.algorithms.regularizers`) is a mean over sequences too.
"""
from typing import Literal

import jax.numpy as jnp

from rstar2_jax.algorithms._checks import check_values
from rstar2_jax.algorithms.loss import aggregate, check_inputs, constant, k3, token_inputs


def gspo_loss(
    logp: jnp.ndarray,
    old_logp: jnp.ndarray,
    advantages: jnp.ndarray,
    mask: jnp.ndarray,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    *,
    loss_agg_mode: Literal["seq-mean-token-mean"] = "seq-mean-token-mean",
) -> tuple[jnp.ndarray, jnp.ndarray, dict[str, jnp.ndarray]]:
    """GSPO's sequence-level clipped loss (Zheng et al. 2025, "Group Sequence Policy
    Optimization", Eq. 5-7), unreduced like `policy_loss`.

    Per sequence i with loss tokens y_i, advantage A_i:

        s_i = exp(mean over t in y_i of (logp_t - old_logp_t))       (length-normalised ratio)
        l_i = -min(s_i * A_i, clip(s_i, 1 - eps_low, 1 + eps_high) * A_i)

    loss_sum = sum of l_i, count = sequences with a loss token: the loss is the mean over
    sequences, and a whole sequence is clipped or not. The paper's clip range, 3e-4 / 4e-4, is
    the default; a sequence ratio moves far less than a token ratio.

    Args:
      logp, old_logp, mask: `[batch, seq]` as in `policy_loss`.
      advantages: `[batch]` per-sequence advantages, or `[batch, seq]` (their token mean is
        the sequence's; verl's ``compute_policy_loss_gspo`` weighs each token's gradient by its
        own advantage instead, which differs only when a sequence's advantages differ).

    Returns:
      `(loss_sum, count, metric_sums)`; metrics are sums over sequences (divided by the total
      count: means over sequences), except `ratio_max`: `clip_low_frac`, `clip_high_frac`
      (share of sequences the clip cuts), `ratio_mean`, `ratio_max` (of s_i), `approx_kl`
      (each sequence's token mean of the k3 estimate of KL(old || policy)).
    """
    check_inputs(logp, old_logp, advantages, mask, loss_agg_mode)
    _check_sequence_mean(loss_agg_mode)
    check_values(eps_low, lambda e: (e >= 0) & (e < 1), f"eps_low must be in [0, 1), got {eps_low}")
    check_values(eps_high, lambda e: e >= 0, f"eps_high must be >= 0, got {eps_high}")
    mask, token_advantages, log_ratio = token_inputs(logp, old_logp, advantages, mask)
    advantages = _per_sequence(advantages, token_advantages, mask)
    ratio = jnp.exp(_mean_over_tokens(log_ratio, mask))
    per_seq = jnp.maximum(-advantages * ratio, -advantages * jnp.clip(ratio, 1 - eps_low, 1 + eps_high))
    metrics = {"clip_low_frac": (advantages < 0) & (ratio < 1 - eps_low),
               "clip_high_frac": (advantages > 0) & (ratio > 1 + eps_high)}
    return _sequence_mean(per_seq, ratio, log_ratio, mask, metrics)


def gmpo_loss(
    logp: jnp.ndarray,
    old_logp: jnp.ndarray,
    advantages: jnp.ndarray,
    mask: jnp.ndarray,
    eps_low: float = 0.4,
    eps_high: float = 0.4,
    *,
    loss_agg_mode: Literal["seq-mean-token-mean"] = "seq-mean-token-mean",
) -> tuple[jnp.ndarray, jnp.ndarray, dict[str, jnp.ndarray]]:
    """GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization", arXiv 2507.20673): the
    geometric mean of the token ratios in place of their arithmetic mean, clipped per token in
    log space,

        c_t = min(sgn(A) * log r_t, sgn(A) * clip(log r_t, -eps_low, eps_high)) * sgn(A)
        l_i = -A_i * exp(mean over t in y_i of c_t)

    so one token with an extreme ratio moves the sequence's ratio by its |y_i|-th root only.
    Like the clipped surrogate, a token is clipped only on the side that would grow the
    objective (above e^eps_high for A > 0, below e^-eps_low for A < 0), and a clipped token has
    no gradient. The paper's range (e^-0.4, e^0.4) is the default. Mean over sequences.

    verl's ``compute_policy_loss_geo_mean`` is the same loss, except that it divides by every row
    of its micro-batch, padding rows included (here: by the sequences with a loss token), and its
    clip fractions count every token outside the range, clipped by the min or not.

    Args:
      logp, old_logp, mask: `[batch, seq]` as in `policy_loss`.
      advantages: `[batch]`, or `[batch, seq]` (each token's sign picks its clip side; the
        sequence's advantage is their token mean, as in verl).

    Returns:
      `(loss_sum, count, metric_sums)`, means over sequences: `clip_low_frac`, `clip_high_frac`
      (each sequence's share of tokens the clip replaced), `ratio_mean`, `ratio_max` (of the
      sequence's clipped geometric-mean ratio), `approx_kl` (token mean of k3, unclipped).
    """
    check_inputs(logp, old_logp, advantages, mask, loss_agg_mode)
    _check_sequence_mean(loss_agg_mode)
    check_values(eps_low, lambda e: e >= 0, f"eps_low must be >= 0, got {eps_low}")
    check_values(eps_high, lambda e: e >= 0, f"eps_high must be >= 0, got {eps_high}")
    mask, token_advantages, log_ratio = token_inputs(logp, old_logp, advantages, mask)
    sign = jnp.sign(token_advantages)
    clipped = sign * jnp.minimum(sign * log_ratio, sign * jnp.clip(log_ratio, -eps_low, eps_high))
    ratio = jnp.exp(_mean_over_tokens(clipped, mask))
    advantages = _per_sequence(advantages, token_advantages, mask)
    metrics = {"clip_low_frac": (token_advantages < 0) & (log_ratio < -eps_low),
               "clip_high_frac": (token_advantages > 0) & (log_ratio > eps_high)}
    return _sequence_mean(-advantages * ratio, ratio, log_ratio, mask, metrics)


def _check_sequence_mean(loss_agg_mode):
    if loss_agg_mode != "seq-mean-token-mean":
        raise ValueError(f"a sequence-level loss is a mean over sequences: loss_agg_mode must be "
                         f"'seq-mean-token-mean', got {loss_agg_mode!r}")


def _mean_over_tokens(x, mask):
    """`[batch, 1]` mean of ``x`` over each row's loss tokens (0 for a row without one)."""
    return jnp.sum(jnp.where(mask, x, 0.0), axis=-1, keepdims=True) / jnp.maximum(
        jnp.sum(mask, axis=-1, keepdims=True), 1)


def _per_sequence(advantages, token_advantages, mask):
    """`[batch, 1]` advantages: as given when one per sequence, else their token mean."""
    if jnp.ndim(advantages) == 1:
        return jnp.where(jnp.any(mask, axis=-1, keepdims=True), jnp.asarray(advantages)[:, None], 0.0)
    return _mean_over_tokens(token_advantages, mask)


def _sequence_mean(per_seq, ratio, log_ratio, mask, token_metrics):
    """The loss contract for per-sequence losses ``per_seq`` and ratios ``ratio`` `[batch, 1]`:
    each spread over its sequence's tokens and averaged as "seq-mean-token-mean" does, which
    sums one value per sequence with count = sequences. ``token_metrics`` are per-token (or
    per-sequence, `[batch, 1]`) values, logged as means over sequences."""
    loss_sum, count, total = aggregate(jnp.where(mask, per_seq, 0.0), mask, "seq-mean-token-mean")
    metrics = {name: total(value) for name, value in token_metrics.items()} | {
        "approx_kl": total(k3(log_ratio)), "ratio_mean": total(ratio),
        "ratio_max": jnp.max(jnp.where(mask, ratio, 0.0))}
    return loss_sum, count, constant(metrics)
