"""Per-token policy losses beside PPO's clipped surrogate (`Algorithm.loss`): CISPO, GPG, SAPO.

Each takes ``(logp, old_logp, advantages, mask)`` `[batch, seq]` (advantages `[batch]` or
`[batch, seq]`) like `policy_loss`, aggregates its per-token losses l_t with `aggregate` (any of
its modes) and returns the unreduced ``(loss_sum, count, metric_sums)`` of the loss contract, so
micro-batches accumulate exactly. r_t = exp(logp_t - old_logp_t) is the token's ratio; every
loss also logs ``approx_kl``, ``ratio_mean`` and ``ratio_max`` (`ratio_metrics`).

On policy (r = 1, one update per rollout batch) CISPO and SAPO have the gradient of plain
REINFORCE with a baseline, -A * grad logp per token, like the clipped surrogate; they differ in
what they do to tokens whose ratio has moved (later mini-batches, or a sampler/trainer gap).
"""
import jax
import jax.numpy as jnp

from rstar2_jax.algorithms._checks import check_values
from rstar2_jax.algorithms.loss import (
    LossAggMode,
    aggregate,
    check_inputs,
    constant,
    ratio_metrics,
    token_inputs,
)


def cispo_loss(
    logp: jnp.ndarray,
    old_logp: jnp.ndarray,
    advantages: jnp.ndarray,
    mask: jnp.ndarray,
    eps_low: float = 1.0,
    eps_high: float = 0.28,
    *,
    loss_agg_mode: LossAggMode = "token-mean",
    norm_length: int | None = None,
) -> tuple[jnp.ndarray, jnp.ndarray, dict[str, jnp.ndarray]]:
    """CISPO (MiniMax 2025, "MiniMax-M1", arXiv 2506.13585: Clipped IS-weight Policy
    Optimization), a REINFORCE loss whose importance weight is clipped and held constant:

        l_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A * logp_t

    averaged over the step's loss tokens. Unlike the clipped surrogate, no token loses its
    gradient: a token far outside the range keeps -w * A * grad logp_t with the clipped weight
    w. The paper sets no lower bound (eps_low large) and tunes only eps_high; the default here
    is eps_low = 1 (the weight is never below 0 anyway) and this library's Clip-Higher 0.28.
    verl's ``compute_policy_loss_cispo`` is the same loss; it also clamps log r to [-20, 20].

    Returns ``(loss_sum, count, metric_sums)`` (module docstring); metrics: ``clip_low_frac``,
    ``clip_high_frac`` (share of tokens whose weight the clip changed, below / above) and the
    ratio metrics.
    """
    check_inputs(logp, old_logp, advantages, mask, loss_agg_mode=loss_agg_mode)
    check_values(eps_low, lambda e: e >= 0, f"eps_low must be >= 0, got {eps_low}")
    check_values(eps_high, lambda e: e >= 0, f"eps_high must be >= 0, got {eps_high}")
    mask, advantages, log_ratio = token_inputs(logp, old_logp, advantages, mask)
    ratio = jnp.exp(log_ratio)
    weight = jax.lax.stop_gradient(jnp.clip(ratio, 1 - eps_low, 1 + eps_high))
    per_token = jnp.where(mask, -weight * advantages * logp, 0.0)
    loss_sum, count, total = aggregate(per_token, mask, loss_agg_mode, norm_length)
    metrics = {"clip_low_frac": total(ratio < 1 - eps_low),
               "clip_high_frac": total(ratio > 1 + eps_high)} | ratio_metrics(log_ratio, mask, total)
    return loss_sum, count, constant(metrics)


def gpg_loss(
    logp: jnp.ndarray,
    old_logp: jnp.ndarray,
    advantages: jnp.ndarray,
    mask: jnp.ndarray,
    *,
    loss_agg_mode: LossAggMode = "token-mean",
    norm_length: int | None = None,
) -> tuple[jnp.ndarray, jnp.ndarray, dict[str, jnp.ndarray]]:
    """GPG's loss (Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline
    for Model Reasoning", arXiv 2504.02546): the policy gradient itself, no surrogate, no ratio,
    no clipping,

        l_t = -A * logp_t,

    averaged over the step's loss tokens (1 / sum_i |o_i|). Its advantage is
    `gpg_advantages` (alpha-scaled). ``old_logp`` enters only the logged ratio metrics.
    verl's ``compute_policy_loss_gpg`` is the same loss.
    """
    check_inputs(logp, old_logp, advantages, mask, loss_agg_mode=loss_agg_mode)
    mask, advantages, log_ratio = token_inputs(logp, old_logp, advantages, mask)
    per_token = jnp.where(mask, -advantages * logp, 0.0)
    loss_sum, count, total = aggregate(per_token, mask, loss_agg_mode, norm_length)
    return loss_sum, count, constant(ratio_metrics(log_ratio, mask, total))


def sapo_loss(
    logp: jnp.ndarray,
    old_logp: jnp.ndarray,
    advantages: jnp.ndarray,
    mask: jnp.ndarray,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    *,
    loss_agg_mode: LossAggMode = "seq-mean-token-mean",
    norm_length: int | None = None,
) -> tuple[jnp.ndarray, jnp.ndarray, dict[str, jnp.ndarray]]:
    """SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization", arXiv 2511.20347): the hard
    clip replaced by a smooth gate of the ratio,

        f(r) = sigmoid(tau * (r - 1)) * 4 / tau,    tau = tau_pos if A > 0 else tau_neg
        l_t = -f(r_t) * A

    averaged per sequence, then over sequences (the paper's 1/G sum_i 1/|y_i| sum_t). The gate's
    slope at r is 4 * s * (1 - s) with s = sigmoid(tau * (r - 1)): exactly 1 at r = 1 (the
    on-policy gradient -A * grad logp_t), and it decays smoothly as r moves away instead of
    dropping to 0 at a clip boundary; a larger tau_neg damps negative tokens faster. Defaults
    are verl's (``compute_policy_loss_sapo``, the same loss: tau_pos 1.0, tau_neg 1.05, log r
    clamped to [-20, 20] there).

    Returns ``(loss_sum, count, metric_sums)``; the ratio metrics only.
    """
    check_inputs(logp, old_logp, advantages, mask, loss_agg_mode=loss_agg_mode)
    check_values(tau_pos, lambda t: t > 0, f"tau_pos must be > 0, got {tau_pos}")
    check_values(tau_neg, lambda t: t > 0, f"tau_neg must be > 0, got {tau_neg}")
    mask, advantages, log_ratio = token_inputs(logp, old_logp, advantages, mask)
    tau = jnp.where(advantages > 0, tau_pos, tau_neg)
    gate = jax.nn.sigmoid(tau * (jnp.exp(log_ratio) - 1)) * 4 / tau
    per_token = jnp.where(mask, -gate * advantages, 0.0)
    loss_sum, count, total = aggregate(per_token, mask, loss_agg_mode, norm_length)
    return loss_sum, count, constant(ratio_metrics(log_ratio, mask, total))
