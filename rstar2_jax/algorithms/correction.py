"""Rollout correction: the gap between the policy that sampled a rollout and the one the trainer
computes, measured, and corrected in the update of any loss.

The sampler's numerics differ from the trainer's (a paged decode path against the training
forward; bfloat16 serving, ``rollout.serving_dtype``, against float32 training), so the
probability pi_sampler(y_t) it drew token y_t with is not the trainer's pi_old(y_t), and the
rollouts are slightly off-policy for the loss. Per loss token,

    rho_t = pi_old(y_t) / pi_sampler(y_t) = exp(old_logp_t - sampler_logp_t)

and per sequence the product prod_t rho_t, or its geometric mean exp(mean_t log rho_t)
(length-normalised, as GSPO's ratio). `RolloutCorrection` (``rl.rollout_correction``) picks

- importance weights (``weights``): w = min(rho, C) per token (truncated importance sampling,
  TIS: Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
  Training"), or one weight per sequence from the product or the geometric mean of its
  ratios, truncated at the same cap C (``weight_cap``);
- masking (``mask``): drop the tokens, or the whole sequences, whose ratio (at the same three
  levels) leaves [low, high] (masked importance sampling, MIS, and verl's rejection sampling).

Both act through what every loss receives (`apply_correction`): the weight multiplies the
token's advantage, the mask removes tokens from the loss mask (and from its denominator). For
every built-in loss this is exactly verl's ``pg_losses * rollout_is_weights`` with a rejected
token's ``response_mask`` at 0, because each is linear in the advantage and a weight is never
negative (the clipped surrogate: w * max(-r A, -clip(r) A) = max(-r wA, -clip(r) wA)), and the
KL penalty is left unweighted as in verl. The weights are constants (no gradient); they are
computed once per step from the trainer's old log-probs, so they do not move between
mini-batches. Sequence-level losses (GSPO, GMPO) average a sequence's weighted advantages.

Differences from verl's ``rollout_corr_helper``: its rejection options bound divergences (k1,
k2, k3) of log(pi_sampler / pi_old), the inverse ratio, so its ``token_k1`` bounds
``lower_upper`` are [1 / high, 1 / low] here; its ``rollout_is="sequence"`` is ``"sequence"``
here and the geometric mean (slime's) has no verl counterpart; batch renormalisation of the
weights is not offered. Log-ratios are clamped to [-20, 20] before exponentiating, as in verl.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp

Level = Literal["none", "token", "sequence", "geometric"]
LEVELS = ("none", "token", "sequence", "geometric")
# Beyond exp(20) ~ 5e8 a ratio carries no more information; the bound keeps exp() finite (verl's).
_LOG_RATIO_BOUND = 20.0


@dataclasses.dataclass(frozen=True)
class RolloutCorrection:
    """The rollout correction of an RL run (``rl.rollout_correction``); off by default.

    weights: "none", or the level of the importance weights: "token" (w_t = min(rho_t, C)),
      "sequence" (w = min(prod_t rho_t, C) for every token of the sequence) or "geometric"
      (w = min(exp(mean_t log rho_t), C)).
    weight_cap: C, the truncation of the weights (> 0; verl's default 2.0; inf: none).
    mask: "none", or the level at which tokens are dropped from the loss: "token" (rho_t outside
      [mask_low, mask_high]), "sequence" (the product of the sequence's ratios outside it: the
      whole sequence) or "geometric" (their geometric mean outside it).
    mask_low, mask_high: the kept range of the ratio, 0 < mask_low <= 1 <= mask_high (inf: no
      upper bound).
    """

    weights: str = "none"
    weight_cap: float = dataclasses.field(default=2.0, metadata={"infinity": "no cap"})  # inf: none
    mask: str = "none"
    mask_low: float = 0.5
    mask_high: float = dataclasses.field(default=2.0, metadata={"infinity": "no upper bound"})  # inf: none

    def __post_init__(self):
        for name in ("weights", "mask"):
            if getattr(self, name) not in LEVELS:
                raise ValueError(f"rl.rollout_correction.{name} must be one of {', '.join(LEVELS)}, "
                                 f"got {getattr(self, name)!r}")
        if not self.weight_cap > 0:
            raise ValueError(f"rl.rollout_correction.weight_cap must be > 0, got {self.weight_cap}")
        if not 0 < self.mask_low <= 1 <= self.mask_high:
            raise ValueError(f"rl.rollout_correction needs 0 < mask_low <= 1 <= mask_high, got "
                             f"mask_low={self.mask_low}, mask_high={self.mask_high}")


def log_ratios(old_logp: jnp.ndarray, sampler_logp: jnp.ndarray, mask: jnp.ndarray,
               level: Level = "token") -> jnp.ndarray:
    """log rho at ``level``: `[batch, seq]` per token ("token"), or `[batch, 1]` per sequence,
    the sum ("sequence") or the mean ("geometric") of its tokens' log rho; clamped to
    [-20, 20], 0 where ``mask`` is False (and for a sequence without a loss token).

    Args:
      old_logp, sampler_logp: `[batch, seq]` the trainer's and the sampler's log-probs (nats).
      mask: `[batch, seq]` loss tokens.
    """
    mask = jnp.asarray(mask).astype(bool)
    token = jnp.where(mask, old_logp - sampler_logp, 0.0)
    if level == "token":
        out = token
    elif level == "sequence":
        out = jnp.sum(token, axis=-1, keepdims=True)
    elif level == "geometric":
        out = jnp.sum(token, axis=-1, keepdims=True) / jnp.maximum(
            jnp.sum(mask, axis=-1, keepdims=True), 1)
    else:
        raise ValueError(f"level must be token, sequence or geometric, got {level!r}")
    return jnp.clip(out, -_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)


def importance_weights(old_logp, sampler_logp, mask, level: Level, cap: float):
    """Truncated importance weights and where the cap acted, both `[batch, seq]`.

    w = min(rho, cap) with rho at ``level`` (`log_ratios`), broadcast to the sequence's tokens
    for the sequence levels; 0 at masked positions. Returns ``(weights, truncated)``, a
    constant float32 array and a bool one (rho > cap on a loss token).
    """
    mask = jnp.asarray(mask).astype(bool)
    ratio = jnp.broadcast_to(jnp.exp(log_ratios(old_logp, sampler_logp, mask, level)), mask.shape)
    weights = jnp.where(mask, jnp.minimum(ratio, cap), 0.0)
    return jax.lax.stop_gradient(weights), mask & (ratio > cap)


def ratio_in_range(old_logp, sampler_logp, mask, level: Level, low: float, high: float):
    """`[batch, seq]` bool: the loss tokens whose ratio at ``level`` lies in [low, high]
    (compared in log space, so a ratio beyond float range is still out)."""
    mask = jnp.asarray(mask).astype(bool)
    log_rho = log_ratios(old_logp, sampler_logp, mask, level)
    inside = (log_rho >= math.log(low)) & (log_rho <= math.log(high))
    return mask & jnp.broadcast_to(inside, mask.shape)


def apply_correction(correction: RolloutCorrection, advantages, old_logp, sampler_logp, mask):
    """What the loss receives under ``correction``: ``(advantages, mask, metrics)``.

    Args:
      correction: the settings.
      advantages: `[batch]` one per rollout.
      old_logp, sampler_logp, mask: `[batch, seq]` as in `log_ratios`.

    Returns:
      advantages: with weights, `[batch, seq]` A_i times each token's weight (0 at masked
        positions); without, the `[batch]` advantages as given.
      mask: `[batch, seq]` bool, the loss mask without the tokens the correction drops.
      metrics: the step's statistics, means over its loss tokens (float32 scalars):
        ``rollout_correction/weight_mean`` and ``rollout_correction/truncated_frac`` (tokens
        whose weight the cap cut) with weights, ``rollout_correction/masked_frac`` (tokens
        dropped) with a mask.
    """
    mask = jnp.asarray(mask).astype(bool)
    metrics = {}
    if correction.weights != "none":
        weights, truncated = importance_weights(old_logp, sampler_logp, mask, correction.weights,
                                                correction.weight_cap)
        advantages = jnp.asarray(advantages, jnp.float32)[:, None] * weights
        metrics["rollout_correction/weight_mean"] = _mean(weights, mask)
        metrics["rollout_correction/truncated_frac"] = _mean(truncated, mask)
    if correction.mask != "none":
        kept = ratio_in_range(old_logp, sampler_logp, mask, correction.mask, correction.mask_low,
                              correction.mask_high)
        metrics["rollout_correction/masked_frac"] = _mean(mask & ~kept, mask)
        mask = kept
    return advantages, mask, metrics


def mismatch_metrics(old_logp, sampler_logp, mask) -> dict[str, jnp.ndarray]:
    """How far the trainer's log-probs are from the sampler's on the loss tokens, float32:

    - ``logprob_mismatch/abs``: mean |old_logp - sampler_logp| (nats per token);
    - ``logprob_mismatch/kl``: mean of rho - log rho - 1, the k3 estimate of KL(sampler || old)
      per token (Schulman, "Approximating KL divergence"; verl's ``rollout_corr/k3_kl``);
    - ``logprob_mismatch/log_ppl_diff``: mean over sequences of log perplexity under the trainer
      minus under the sampler, i.e. of mean_t sampler_logp - mean_t old_logp (verl's
      ``log_ppl_diff``: > 0 when the trainer finds the rollouts less likely than the sampler);
    - ``logprob_mismatch/log_ppl_abs_diff``: the mean of its absolute value;
    - ``logprob_mismatch/ratio_max``, ``logprob_mismatch/ratio_min``: the largest and the
      smallest token ratio rho (log-ratio clamped to [-20, 20]).

    A sequence without a loss token (padding) is left out; with no loss token at all every
    value is 0.
    """
    mask = jnp.asarray(mask).astype(bool)
    log_rho = log_ratios(old_logp, sampler_logp, mask)
    rows = jnp.any(mask, axis=-1)
    seq_diff = -log_ratios(old_logp, sampler_logp, mask, "geometric")[:, 0]
    any_token = jnp.any(mask)

    def seq_mean(x):
        return jnp.sum(jnp.where(rows, x, 0.0)) / jnp.maximum(jnp.sum(rows), 1)

    return {"logprob_mismatch/abs": _mean(jnp.abs(log_rho), mask),
            "logprob_mismatch/kl": _mean(jnp.exp(log_rho) - log_rho - 1.0, mask),
            "logprob_mismatch/log_ppl_diff": seq_mean(seq_diff),
            "logprob_mismatch/log_ppl_abs_diff": seq_mean(jnp.abs(seq_diff)),
            "logprob_mismatch/ratio_max": jnp.where(
                any_token, jnp.exp(jnp.max(jnp.where(mask, log_rho, -jnp.inf))), 0.0),
            "logprob_mismatch/ratio_min": jnp.where(
                any_token, jnp.exp(jnp.min(jnp.where(mask, log_rho, jnp.inf))), 0.0)}


def _mean(x, mask):
    """Mean of ``x`` over the loss tokens (0 without one), float32."""
    return (jnp.sum(jnp.where(mask, x, 0)) / jnp.maximum(jnp.sum(mask), 1)).astype(jnp.float32)
