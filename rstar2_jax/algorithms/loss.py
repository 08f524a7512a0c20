"""The PPO clipped surrogate of GRPO-RoC, DAPO and Dr. GRPO (`policy_loss`, an `Algorithm.loss`),
and the aggregation every per-token loss shares (`aggregate`). The other losses are in
`token_losses` (CISPO, GPG, SAPO) and `sequence_losses` (GSPO, GMPO).

Per loss token t of rollout i, with ratio r = exp(logp - old_logp) and advantage A = A_i:

    l_t = -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)          (rStar2-Agent Eq. 6)

Clip-Higher (eps_high = 0.28 > eps_low = 0.2) leaves more room for raising the probability of
unlikely tokens. The gradient of l_t with respect to logp_t is -A * r where the unclipped branch
is the minimum and 0 where the clipped one is: for A > 0 once r > 1 + eps_high, for A < 0 once
r < 1 - eps_low. Optional dual clip (Ye et al. 2020) bounds the loss of a negative-advantage token at
-dual_clip * A, so a token whose probability already grew a lot cannot produce an unbounded step.
No KL and no entropy term (the paper removed both); any algorithm can add them
(`rstar2_jax.algorithms.regularizers`: ``rl.entropy_coef``, ``rl.kl_coef``).

Aggregation and gradient accumulation: the function returns an unreduced `(loss_sum, count,
metric_sums)`, the contract of `Algorithm.loss` and of the train step. For an optimizer step split
into micro-batches the loss is

    sum(loss_sum over micro-batches) / sum(count over micro-batches),

which is exactly the full-batch value for every mode below (divide once, after summing):

- "token-mean" (default, paper, DAPO): loss_sum = sum of l_t over loss tokens, count = number of
  loss tokens. Every token weighs the same, whatever the length of its sequence.
- "seq-mean-token-mean" (original GRPO): loss_sum = sum over sequences of that sequence's mean
  l_t, count = number of sequences with at least one loss token. Every sequence weighs the
  same, so a token of a short answer weighs more than a token of a long one.
- "seq-mean-token-sum" (Dr. GRPO): loss_sum = sum of l_t over loss tokens, count = number of
  sequences with at least one loss token. Every token weighs the same and the normaliser does
  not depend on the lengths.
- "seq-mean-token-sum-norm" (the Dr. GRPO authors' code): loss_sum = sum of l_t over loss tokens
  divided by a fixed length L (``norm_length``, e.g. the generation budget), count = number of
  sequences with at least one loss token: the mean over sequences of (token sum / L). verl's
  mode of that name divides each micro-batch's token sum by L and the micro-batch losses by the
  gradient-accumulation steps, not by the sequences, so its value grows with its micro-batch
  size; here it does not depend on how the step is split. Without ``norm_length``, L is the
  mask's last dimension (the padded row length, as verl's default is its padded response length).

The metrics are divided by the same total count, so each metric sum weighs a token as the count
does: by 1 for "token-mean" (token means over the step), by 1 / (its sequence's loss tokens) for
the three sequence modes (means over sequences of each sequence's token mean).
"""
from typing import Literal

import jax
import jax.numpy as jnp

from rstar2_jax.algorithms._checks import check_values

LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                      "seq-mean-token-sum-norm"]
_LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def policy_loss(
    logp: jnp.ndarray,
    old_logp: jnp.ndarray,
    advantages: jnp.ndarray,
    mask: jnp.ndarray,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    *,
    dual_clip: float | None = None,
    loss_agg_mode: LossAggMode = "token-mean",
    norm_length: int | None = None,
) -> tuple[jnp.ndarray, jnp.ndarray, dict[str, jnp.ndarray]]:
    """Clipped policy-gradient loss of one (micro-)batch, unreduced for exact accumulation.

    Args:
      logp: `[batch, seq]` log-probabilities (nats) of the sampled tokens under the policy being
        trained; the gradient flows through these only.
      old_logp: `[batch, seq]` log-probabilities of the same tokens under the policy that sampled
        them. A constant (no gradient flows through it), so `old_logp=logp` gives the on-policy
        loss, whose gradient is -A / N per token for token-mean.
      advantages: `[batch]` per-rollout advantages (broadcast to every token) or `[batch, seq]`.
      mask: `[batch, seq]` loss mask, nonzero for tokens the model generated. Values at masked
        positions of every other array are ignored, even inf or NaN.
      eps_low: lower clip range, the ratio is clipped below at 1 - eps_low.
      eps_high: upper clip range (Clip-Higher), the ratio is clipped above at 1 + eps_high.
      dual_clip: if set (> 1, e.g. 3.0), caps a negative-advantage token's loss at -dual_clip * A.
      loss_agg_mode: "token-mean", "seq-mean-token-mean", "seq-mean-token-sum" or
        "seq-mean-token-sum-norm" (module docstring).
      norm_length: L of "seq-mean-token-sum-norm" (tokens, > 0); ignored by the other modes.

    Returns:
      `(loss_sum, count, metric_sums)`: float32 scalar, int32 scalar (loss tokens for
      token-mean, non-empty sequences otherwise) and a dict of float32 scalars to be divided by
      the total count (module docstring), except `ratio_max`, a maximum: `clip_low_frac`,
      `clip_high_frac` (share of tokens whose gradient the low / high clip cuts);
      `dual_clip_frac` if `dual_clip`; `approx_kl` (k3 estimate of KL(old || policy));
      `ratio_mean`, `ratio_max`. With no loss token every value is 0.
    """
    check_inputs(logp, old_logp, advantages, mask, loss_agg_mode)
    check_values(eps_low, lambda e: (e >= 0) & (e < 1), f"eps_low must be in [0, 1), got {eps_low}")
    check_values(eps_high, lambda e: e >= 0, f"eps_high must be >= 0, got {eps_high}")
    if dual_clip is not None:
        check_values(dual_clip, lambda c: c > 1, f"dual_clip must be > 1, got {dual_clip}")

    mask, advantages, log_ratio = token_inputs(logp, old_logp, advantages, mask)
    ratio = jnp.exp(log_ratio)

    per_token = jnp.maximum(-advantages * ratio, -advantages * jnp.clip(ratio, 1 - eps_low, 1 + eps_high))
    if dual_clip is not None:
        per_token = jnp.where(advantages < 0, jnp.minimum(per_token, -advantages * dual_clip), per_token)
    per_token = jnp.where(mask, per_token, 0.0)

    loss_sum, count, total = aggregate(per_token, mask, loss_agg_mode, norm_length)
    metrics = {
        "clip_low_frac": total((advantages < 0) & (ratio < 1 - eps_low)),
        "clip_high_frac": total((advantages > 0) & (ratio > 1 + eps_high)),
    } | ratio_metrics(log_ratio, mask, total)
    if dual_clip is not None:
        metrics["dual_clip_frac"] = total((advantages < 0) & (ratio > dual_clip))
    return loss_sum, count, constant(metrics)


def token_inputs(logp, old_logp, advantages, mask):
    """``(mask, advantages, log_ratio)`` of a per-token loss: the bool mask, the advantages
    `[batch, seq]` and ``logp - old_logp`` (no gradient through ``old_logp``), both 0 at masked
    positions. Masked values are replaced *before* any arithmetic: multiplying a garbage value
    by a zero mask is not enough, since 0 * inf = NaN, in the loss and in its gradient."""
    mask = jnp.asarray(mask).astype(bool)
    advantages = jnp.asarray(advantages)
    if advantages.ndim == 1:
        advantages = advantages[:, None]
    advantages = jnp.where(mask, advantages, 0.0)
    log_ratio = jnp.where(mask, logp - jax.lax.stop_gradient(old_logp), 0.0)
    return mask, advantages, log_ratio


def aggregate(per_token: jnp.ndarray, mask: jnp.ndarray, mode: LossAggMode,
              norm_length: int | None = None):
    """``(loss_sum, count, total)`` of the per-token losses ``per_token`` `[batch, seq]` (its
    values where ``mask`` is False are ignored; they must be finite where the result is
    differentiated) under aggregation ``mode`` (module docstring); ``total(x)`` sums a
    per-token metric ``x`` with the weights that make ``sum(total) / sum(count)`` the mean the
    loss takes (token means for "token-mean", means over sequences of token means otherwise)."""
    if mode == "seq-mean-token-sum-norm":
        norm_length = mask.shape[-1] if norm_length is None else norm_length
        check_values(norm_length, lambda n: n > 0, f"norm_length must be > 0, got {norm_length}")
    mask = jnp.asarray(mask).astype(bool)
    per_token = jnp.where(mask, per_token, 0.0)
    tokens_per_row = jnp.sum(mask, axis=-1)
    if mode == "token-mean":
        loss_sum, count = jnp.sum(per_token), jnp.sum(tokens_per_row, dtype=jnp.int32)
        weight = mask.astype(jnp.float32)
    else:
        weight = mask / jnp.maximum(tokens_per_row, 1)[:, None]
        loss_sum = {"seq-mean-token-mean": lambda: jnp.sum(per_token * weight),
                    "seq-mean-token-sum": lambda: jnp.sum(per_token),
                    "seq-mean-token-sum-norm": lambda: jnp.sum(per_token) / norm_length}[mode]()
        count = jnp.sum(tokens_per_row > 0, dtype=jnp.int32)

    def total(x):
        return jnp.sum(jnp.where(mask, x * weight, 0.0))

    return loss_sum.astype(jnp.float32), count, total


def ratio_metrics(log_ratio: jnp.ndarray, mask: jnp.ndarray, total) -> dict[str, jnp.ndarray]:
    """Sums of the k3 estimate of KL(old || policy) (``approx_kl``) and of the ratio
    (``ratio_mean``), weighted by ``total``, and the largest ratio of a loss token
    (``ratio_max``), from the per-token log-ratios `[batch, seq]` (0 where masked)."""
    ratio = jnp.exp(log_ratio)
    return {"approx_kl": total(k3(log_ratio)), "ratio_mean": total(ratio),
            "ratio_max": jnp.max(jnp.where(mask, ratio, 0.0))}


def constant(metrics):
    """The metrics as float32 constants (no gradient flows into a logged value)."""
    return {name: jax.lax.stop_gradient(value).astype(jnp.float32) for name, value in metrics.items()}


def k3(log_q_over_p):
    """Per-token k3 estimate of KL(p || q) from samples of p: q/p - log(q/p) - 1, always >= 0
    and lower-variance than -log(q/p) (Schulman, "Approximating KL divergence")."""
    return jnp.exp(log_q_over_p) - log_q_over_p - 1


def check_inputs(logp, old_logp, advantages, mask, loss_agg_mode="token-mean"):
    """ValueError for inputs of the wrong shapes or an unknown aggregation mode."""
    if loss_agg_mode not in _LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {_LOSS_AGG_MODES}, got {loss_agg_mode!r}")
    shape = jnp.shape(logp)
    if len(shape) != 2:
        raise ValueError(f"logp must be [batch, seq], got shape {shape}")
    for name, x in (("old_logp", old_logp), ("mask", mask)):
        if jnp.shape(x) != shape:
            raise ValueError(f"{name} must have logp's shape {shape}, got {jnp.shape(x)}")
    if jnp.shape(advantages) not in (shape[:1], shape):
        raise ValueError(f"advantages must be [batch] {shape[:1]} or [batch, seq] {shape}, got {jnp.shape(advantages)}")
