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
  ratios, truncated at the same cap C (``weight_cap``). Per token, ``weight_rule`` replaces
  the truncation by the rule of another source, each giving weight rho to the tokens it keeps
  and 0 to the others, which stay in the loss's token count: AReaL's cap (`areal_weights`),
  IcePop's two-sided window (`icepop_weights`), M2PO's second-moment mask (`m2po_weights`);
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
# What happens to a token's weight rho: truncated at the cap (TIS), or kept or zeroed by the rule
# of AReaL, IcePop or M2PO (each per token, as its source defines it).
WEIGHT_RULES = ("tis", "areal", "icepop", "m2po")
# Beyond exp(20) ~ 5e8 a ratio carries no more information; the bound keeps exp() finite (verl's).
_LOG_RATIO_BOUND = 20.0


@dataclasses.dataclass(frozen=True)
class RolloutCorrection:
    """The rollout correction of an RL run (``rl.rollout_correction``); off by default.

    weights: "none", or the level of the importance weights: "token" (w_t = min(rho_t, C)),
      "sequence" (w = min(prod_t rho_t, C) for every token of the sequence) or "geometric"
      (w = min(exp(mean_t log rho_t), C)).
    weight_rule: what the cap does to a token's weight: "tis" (truncation, above), or, with
      ``weights="token"``, w_t = rho_t on the tokens a rule keeps and 0 on the others, which
      stay in the loss's token count: "areal" (kept where rho_t <= C: AReaL's
      ``behav_imp_weight_cap``), "icepop" (kept where weight_floor <= rho_t <= C: IcePop) or
      "m2po" (the largest (log rho_t)^2 dropped until the mean of the kept ones is below
      m2_threshold: M2PO).
    weight_cap: C, the truncation of the weights (> 0; verl's default 2.0; inf: none); for
      "areal" and "icepop" the largest ratio kept (> 1; AReaL's configs and IcePop's beta: 5).
    weight_floor: IcePop's alpha, the smallest ratio kept (in [0, 1); its default 0.5).
    m2_threshold: M2PO's tau_M2, the bound on the mean (log rho)^2 of the kept tokens (> 0;
      its default 0.04).
    mask: "none", or the level at which tokens are dropped from the loss: "token" (rho_t outside
      [mask_low, mask_high]), "sequence" (the product of the sequence's ratios outside it: the
      whole sequence) or "geometric" (their geometric mean outside it).
    mask_low, mask_high: the kept range of the ratio, 0 < mask_low <= 1 <= mask_high (inf: no
      upper bound).
    """

    weights: str = "none"
    weight_rule: str = "tis"
    weight_cap: float = dataclasses.field(default=2.0, metadata={"infinity": "no cap"})  # inf: none
    weight_floor: float = 0.5
    m2_threshold: float = 0.04
    mask: str = "none"
    mask_low: float = 0.5
    mask_high: float = dataclasses.field(default=2.0, metadata={"infinity": "no upper bound"})  # inf: none

    def __post_init__(self):
        for name in ("weights", "mask"):
            if getattr(self, name) not in LEVELS:
                raise ValueError(f"rl.rollout_correction.{name} must be one of {', '.join(LEVELS)}, "
                                 f"got {getattr(self, name)!r}")
        if self.weight_rule not in WEIGHT_RULES:
            raise ValueError(f"rl.rollout_correction.weight_rule must be one of {', '.join(WEIGHT_RULES)}, "
                             f"got {self.weight_rule!r}")
        if self.weight_rule != "tis" and self.weights != "token":
            # Each source defines its rule per token; without weights the rule would do nothing.
            raise ValueError(f"rl.rollout_correction.weight_rule={self.weight_rule} weighs tokens: "
                             f"set rl.rollout_correction.weights=token (got {self.weights!r})")
        if not self.weight_cap > 0:
            raise ValueError(f"rl.rollout_correction.weight_cap must be > 0, got {self.weight_cap}")
        if self.weight_rule in ("areal", "icepop") and not self.weight_cap > 1:
            # At C <= 1 rounding alone would zero about half of the on-policy tokens (AReaL's check).
            raise ValueError(f"rl.rollout_correction.weight_rule={self.weight_rule} needs weight_cap > 1, "
                             f"got {self.weight_cap}")
        if not 0 <= self.weight_floor < 1:
            raise ValueError(f"rl.rollout_correction.weight_floor must be in [0, 1), got {self.weight_floor}")
        if not self.m2_threshold > 0:
            raise ValueError(f"rl.rollout_correction.m2_threshold must be > 0, got {self.m2_threshold}")
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


def areal_weights(old_logp, sampler_logp, mask, cap: float):
    """AReaL's cap on the decoupled-PPO weight, `[batch, seq]` ``(weights, zeroed)``:
    w_t = rho_t where rho_t <= cap, 0 where it is above (``zeroed``); the zeroed tokens stay
    in the loss's token count.

    AReaL's ``ppo_actor_loss_fn`` (``areal/utils/functional.py``, ``use_decoupled_loss`` with
    ``behav_imp_weight_cap`` = C; proximal = the trainer's old log-probs, old = the sampler's)::

        behav_imp_weight = exp(proximal_logprobs - old_logprobs)
        behav_mask = (behav_imp_weight <= C) & loss_mask
        loss = sum(where(loss_mask, pg_loss * where(behav_mask, behav_imp_weight, 0))) / count(loss_mask)

    Truncation (`importance_weights`) instead gives such a token the weight C.
    """
    return _kept_ratio(old_logp, sampler_logp, mask, 0.0, cap)


def icepop_weights(old_logp, sampler_logp, mask, low: float, high: float):
    """IcePop's two-sided window, `[batch, seq]` ``(weights, zeroed)``: w_t = M(rho_t), with
    M(k) = k for low <= k <= high and 0 outside (``zeroed``, left in the token count).

    Ling Team 2025, "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale
    Thinking Model" (Ring-1T, arXiv 2510.18855), IcePop:
    J = E[1/G sum_i 1/|y_i| sum_t M(pi_train(y_t; theta_old) / pi_infer(y_t; theta_old))
    * min(r_t A, clip(r_t, 1 - eps, 1 + eps) A)], alpha = 0.5 and beta = 5 in its blog.
    """
    return _kept_ratio(old_logp, sampler_logp, mask, low, high)


def m2po_weights(old_logp, sampler_logp, mask, threshold: float):
    """M2PO's second-moment mask, `[batch, seq]` ``(weights, zeroed)``: w_t = rho_t M_t, 0 on
    the tokens M2PO drops (``zeroed``, left in the token count).

    Zheng, Zhao and Chen 2025, "Prosperity before Collapse: How Far Can Off-Policy RL Reach
    with Stale Data on LLMs?" (arXiv 2510.01161), Algorithm 1, as AReaL implements it
    (``actor.m2_threshold``): M_{2,t} = (log rho_t)^2; sorted in descending order, the fewest
    largest are dropped such that the mean of the others is below tau_M2 (all but the smallest
    when no such count exists); the objective is
    1 / sum_i |o_i| * sum_{i,t} M_t * pi_theta / pi_behav * A_{i,t}. The batch is the step's
    loss tokens (all rows). Here pi_theta / pi_behav = r_t rho_t at the step's params, so with
    one mini-batch the mask is the paper's; with several, the paper recomputes it per
    mini-batch against the moved policy, this one keeps the step's. (The authors' released
    code caps the ratios of the tokens whose ratio moves with the advantage instead of
    masking.)
    """
    mask = jnp.asarray(mask).astype(bool)
    log_rho = log_ratios(old_logp, sampler_logp, mask)
    second = jnp.where(mask, log_rho ** 2, -1.0).reshape(-1)  # off-mask positions sort last
    order = jnp.argsort(-second, stable=True)
    index = jnp.arange(second.size)
    n = jnp.sum(mask)
    ranked = jnp.where(index < n, second[order], 0.0)
    suffix_mean = jnp.cumsum(ranked[::-1])[::-1] / jnp.maximum(n - index, 1)
    below = (index < n) & (suffix_mean < threshold)
    dropped = jnp.where(jnp.any(below), jnp.argmax(below), jnp.maximum(n - 1, 0))
    rank = jnp.zeros_like(index).at[order].set(index).reshape(mask.shape)
    kept = mask & (rank >= dropped)
    return jax.lax.stop_gradient(jnp.where(kept, jnp.exp(log_rho), 0.0)), mask & ~kept


def _kept_ratio(old_logp, sampler_logp, mask, low: float, high: float):
    """``(weights, zeroed)``: rho_t on the loss tokens with low <= rho_t <= high (in log space;
    low = 0 bounds nothing), 0 elsewhere; ``zeroed`` the loss tokens outside."""
    mask = jnp.asarray(mask).astype(bool)
    kept = ratio_in_range(old_logp, sampler_logp, mask, "token", low, high)
    rho = jnp.exp(log_ratios(old_logp, sampler_logp, mask))
    return jax.lax.stop_gradient(jnp.where(kept, rho, 0.0)), mask & ~kept


def ratio_in_range(old_logp, sampler_logp, mask, level: Level, low: float, high: float):
    """`[batch, seq]` bool: the loss tokens whose ratio at ``level`` lies in [low, high]
    (compared in log space, so a ratio beyond float range is still out; low = 0 bounds
    nothing)."""
    mask = jnp.asarray(mask).astype(bool)
    log_rho = log_ratios(old_logp, sampler_logp, mask, level)
    inside = (log_rho >= (math.log(low) if low > 0 else -math.inf)) & (log_rho <= math.log(high))
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
        ``rollout_correction/weight_mean`` with weights, and ``rollout_correction/truncated_frac``
        (tokens whose weight the cap cut; "tis") or ``rollout_correction/zeroed_frac`` (tokens
        the rule gave weight 0; the other rules); ``rollout_correction/masked_frac`` (tokens
        dropped) with a mask.
    """
    mask = jnp.asarray(mask).astype(bool)
    metrics = {}
    if correction.weights != "none":
        weights, capped = _weights(correction, old_logp, sampler_logp, mask)
        advantages = jnp.asarray(advantages, jnp.float32)[:, None] * weights
        metrics["rollout_correction/weight_mean"] = _mean(weights, mask)
        capped_name = "truncated_frac" if correction.weight_rule == "tis" else "zeroed_frac"
        metrics[f"rollout_correction/{capped_name}"] = _mean(capped, mask)
    if correction.mask != "none":
        kept = ratio_in_range(old_logp, sampler_logp, mask, correction.mask, correction.mask_low,
                              correction.mask_high)
        metrics["rollout_correction/masked_frac"] = _mean(mask & ~kept, mask)
        mask = kept
    return advantages, mask, metrics


def _weights(correction: RolloutCorrection, old_logp, sampler_logp, mask):
    """The weights of ``correction``'s rule and the tokens its cap acted on (truncated by
    "tis", zeroed by the others), both `[batch, seq]`."""
    if correction.weight_rule == "areal":
        return areal_weights(old_logp, sampler_logp, mask, correction.weight_cap)
    if correction.weight_rule == "icepop":
        return icepop_weights(old_logp, sampler_logp, mask, correction.weight_floor, correction.weight_cap)
    if correction.weight_rule == "m2po":
        return m2po_weights(old_logp, sampler_logp, mask, correction.m2_threshold)
    return importance_weights(old_logp, sampler_logp, mask, correction.weights, correction.weight_cap)


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
