"""Rollout correction: importance weights and masks at the token, sequence and geometric-mean
levels, the weight rules of AReaL, IcePop and M2PO (hand-computed values, and each source's
objective written out here from its formula), the mismatch metrics, and the correction's effect
on the losses (values and gradients equal to verl's per-token multiplication by the weights,
with a rejected token out of the mask)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstar2_jax.algorithms import (
    RolloutCorrection,
    apply_correction,
    areal_weights,
    cispo_loss,
    gpg_loss,
    icepop_weights,
    importance_weights,
    log_ratios,
    m2po_weights,
    mismatch_metrics,
    policy_loss,
    ratio_in_range,
    sapo_loss,
)

# Two rollouts: row 0 has 3 loss tokens with trainer/sampler ratios 1.5, 0.5 and 4; row 1 has
# 2 with ratios 1.1 and 1.2; row 2 is padding (garbage in the sampler's log-probs).
RATIOS = np.array([[1.5, 0.5, 4.0, 1.0], [1.1, 1.2, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
MASK = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]], bool)
OLD = np.full(RATIOS.shape, -2.0)
SAMPLER = np.where(MASK, OLD - np.log(RATIOS), np.nan)


def test_log_ratios_at_each_level():
    token = np.asarray(log_ratios(OLD, SAMPLER, MASK))
    np.testing.assert_allclose(token, np.where(MASK, np.log(RATIOS), 0.0), rtol=1e-6)
    np.testing.assert_allclose(log_ratios(OLD, SAMPLER, MASK, "sequence")[:, 0],
                               [np.log(3.0), np.log(1.32), 0.0], rtol=1e-6)
    np.testing.assert_allclose(log_ratios(OLD, SAMPLER, MASK, "geometric")[:, 0],
                               [np.log(3.0) / 3, np.log(1.32) / 2, 0.0], rtol=1e-6)
    # Clamped to [-20, 20]: a ratio beyond float range stays finite.
    assert float(log_ratios(jnp.array([[0.0]]), jnp.array([[-100.0]]), jnp.array([[True]]))[0, 0]) == 20.0


def test_truncated_importance_weights():
    weights, truncated = importance_weights(OLD, SAMPLER, MASK, "token", 2.0)
    np.testing.assert_allclose(weights, np.where(MASK, np.minimum(RATIOS, 2.0), 0.0), rtol=1e-6)
    np.testing.assert_array_equal(truncated, MASK & (RATIOS > 2.0))
    # Sequence: the product, 3.0 (capped at 2) and 1.32, on every token of the sequence.
    weights, truncated = importance_weights(OLD, SAMPLER, MASK, "sequence", 2.0)
    np.testing.assert_allclose(weights, np.where(MASK, [[2.0], [1.32], [0.0]], 0.0), rtol=1e-6)
    np.testing.assert_array_equal(truncated, MASK & np.array([[True], [False], [False]]))
    # Geometric mean: 3^(1/3) and 1.32^(1/2), both under the cap.
    weights, truncated = importance_weights(OLD, SAMPLER, MASK, "geometric", 2.0)
    np.testing.assert_allclose(weights, np.where(MASK, [[3 ** (1 / 3)], [1.32 ** 0.5], [0.0]], 0.0), rtol=1e-6)
    assert not np.any(truncated)


def test_masks_keep_ratios_inside_the_range():
    np.testing.assert_array_equal(ratio_in_range(OLD, SAMPLER, MASK, "token", 0.5, 2.0),
                                  MASK & (RATIOS >= 0.5) & (RATIOS <= 2.0))
    # The product 3.0 is out: the whole of row 0 goes; row 1 (1.32) stays.
    np.testing.assert_array_equal(ratio_in_range(OLD, SAMPLER, MASK, "sequence", 0.5, 2.0),
                                  MASK & np.array([[False], [True], [True]]))
    np.testing.assert_array_equal(ratio_in_range(OLD, SAMPLER, MASK, "geometric", 0.5, 1.2),
                                  MASK & np.array([[False], [True], [True]]))  # 1.44 out, 1.149 in


def test_mismatch_metrics_closed_form():
    m = {k: float(v) for k, v in mismatch_metrics(OLD, SAMPLER, MASK).items()}
    log_r = np.log(RATIOS[MASK])
    assert m["logprob_mismatch/abs"] == pytest.approx(np.mean(np.abs(log_r)), rel=1e-6)
    assert m["logprob_mismatch/kl"] == pytest.approx(np.mean(np.exp(log_r) - log_r - 1), rel=1e-6)
    # Per sequence: mean sampler log-prob minus mean trainer log-prob = -(mean log ratio).
    diffs = np.array([-np.log(3.0) / 3, -np.log(1.32) / 2])
    assert m["logprob_mismatch/log_ppl_diff"] == pytest.approx(diffs.mean(), rel=1e-6)
    assert m["logprob_mismatch/log_ppl_abs_diff"] == pytest.approx(np.abs(diffs).mean(), rel=1e-6)
    assert m["logprob_mismatch/ratio_max"] == pytest.approx(4.0, rel=1e-6)
    assert m["logprob_mismatch/ratio_min"] == pytest.approx(0.5, rel=1e-6)
    empty = mismatch_metrics(OLD, SAMPLER, np.zeros_like(MASK))
    assert all(float(v) == 0.0 for v in empty.values())


def test_apply_correction_statistics_and_no_correction():
    adv = jnp.array([1.0, -2.0, 0.0])
    same_adv, same_mask, metrics = apply_correction(RolloutCorrection(), adv, OLD, SAMPLER, MASK)
    assert same_adv is adv and metrics == {}
    np.testing.assert_array_equal(same_mask, MASK)

    both = RolloutCorrection(weights="token", weight_cap=2.0, mask="token", mask_low=0.6, mask_high=3.0)
    advantages, mask, metrics = apply_correction(both, adv, OLD, SAMPLER, MASK)
    weights = np.minimum(RATIOS, 2.0)
    np.testing.assert_allclose(advantages, np.where(MASK, np.asarray(adv)[:, None] * weights, 0.0), rtol=1e-6)
    np.testing.assert_array_equal(mask, MASK & (RATIOS >= 0.6) & (RATIOS <= 3.0))
    assert float(metrics["rollout_correction/weight_mean"]) == pytest.approx(weights[MASK].mean(), rel=1e-6)
    assert float(metrics["rollout_correction/truncated_frac"]) == pytest.approx(1 / 5)
    assert float(metrics["rollout_correction/masked_frac"]) == pytest.approx(2 / 5)  # 0.5 and 4


def test_settings_are_checked():
    with pytest.raises(ValueError, match="rl.rollout_correction.weights"):
        RolloutCorrection(weights="tis")
    with pytest.raises(ValueError, match="weight_cap"):
        RolloutCorrection(weight_cap=0.0)
    with pytest.raises(ValueError, match="mask_low"):
        RolloutCorrection(mask_low=1.5)
    with pytest.raises(ValueError, match="weight_rule must be one of tis, areal, icepop, m2po"):
        RolloutCorrection(weights="token", weight_rule="mis")
    # A rule weighs tokens: without token weights it would silently do nothing.
    for weights in ("none", "sequence", "geometric"):
        with pytest.raises(ValueError, match="weight_rule=icepop weighs tokens: set rl.rollout_correction.weights=token"):
            RolloutCorrection(weights=weights, weight_rule="icepop")
    with pytest.raises(ValueError, match="weight_rule=areal needs weight_cap > 1"):
        RolloutCorrection(weights="token", weight_rule="areal", weight_cap=1.0)
    with pytest.raises(ValueError, match="weight_floor must be in"):
        RolloutCorrection(weights="token", weight_rule="icepop", weight_floor=1.0)
    with pytest.raises(ValueError, match="m2_threshold must be > 0"):
        RolloutCorrection(weights="token", weight_rule="m2po", m2_threshold=0.0)
    RolloutCorrection(weights="token", weight_rule="tis", weight_cap=0.5)  # TIS may cap below 1


# --- the weight rules: hand-computed values ------------------------------------------------------

def test_areal_gives_weight_zero_over_the_cap_and_keeps_the_token_count():
    weights, zeroed = areal_weights(OLD, SAMPLER, MASK, 2.0)
    # Ratios 1.5, 0.5, 4 | 1.1, 1.2: only the 4 is over the cap, and its weight is 0, not 2.
    np.testing.assert_allclose(weights, [[1.5, 0.5, 0.0, 0.0], [1.1, 1.2, 0.0, 0.0], [0.0] * 4], rtol=1e-6)
    np.testing.assert_array_equal(zeroed, MASK & (RATIOS > 2.0))
    # A ratio exactly at the cap is kept (AReaL: weight <= cap); in log space, as the mask.
    np.testing.assert_allclose(areal_weights(OLD, SAMPLER, MASK, 4.0)[0][0], [1.5, 0.5, 4.0, 0.0], rtol=1e-6)
    adv = jnp.array([1.0, -2.0, 0.0])
    advantages, mask, metrics = apply_correction(
        RolloutCorrection(weights="token", weight_rule="areal"), adv, OLD, SAMPLER, MASK)
    np.testing.assert_array_equal(mask, MASK)  # nothing leaves the loss's token count
    np.testing.assert_allclose(advantages, [[1.5, 0.5, 0.0, 0.0], [-2.2, -2.4, 0.0, 0.0], [0.0] * 4], rtol=1e-6)
    assert float(metrics["rollout_correction/weight_mean"]) == pytest.approx((1.5 + 0.5 + 1.1 + 1.2) / 5)
    assert float(metrics["rollout_correction/zeroed_frac"]) == pytest.approx(1 / 5)
    assert "rollout_correction/truncated_frac" not in metrics


def test_icepop_keeps_the_ratios_inside_its_window_untruncated():
    weights, zeroed = icepop_weights(OLD, SAMPLER, MASK, 0.6, 5.0)
    # alpha 0.6, beta 5: the 0.5 is below the window; 4 is inside and keeps its whole weight.
    np.testing.assert_allclose(weights, [[1.5, 0.0, 4.0, 0.0], [1.1, 1.2, 0.0, 0.0], [0.0] * 4], rtol=1e-6)
    np.testing.assert_array_equal(zeroed, MASK & (RATIOS < 0.6))
    weights, zeroed = icepop_weights(OLD, SAMPLER, MASK, 0.5, 1.15)  # both bounds inclusive
    np.testing.assert_allclose(weights, [[0.0, 0.5, 0.0, 0.0], [1.1, 0.0, 0.0, 0.0], [0.0] * 4], rtol=1e-6)
    np.testing.assert_array_equal(zeroed, MASK & ((RATIOS < 0.5) | (RATIOS > 1.15)))


def test_m2po_drops_the_fewest_largest_second_moments():
    # (log rho)^2: 0.164, 0.480, 1.922 | 0.0091, 0.0332. Sorted down: 1.922, 0.480, 0.164, 0.0332,
    # 0.0091, whose suffix means are 0.522, 0.172, 0.0689, 0.0212, 0.0091: the first below
    # 0.04 leaves out three, the ratios 4, 0.5 and 1.5.
    weights, zeroed = m2po_weights(OLD, SAMPLER, MASK, 0.04)
    np.testing.assert_allclose(weights, [[0.0, 0.0, 0.0, 0.0], [1.1, 1.2, 0.0, 0.0], [0.0] * 4], rtol=1e-6)
    np.testing.assert_array_equal(zeroed, MASK & (RATIOS != 1.1) & (RATIOS != 1.2))
    # At 0.1 two go (0.0689 < 0.1); at 1.0 none (0.522 < 1); the kept tokens keep rho untruncated.
    np.testing.assert_allclose(m2po_weights(OLD, SAMPLER, MASK, 0.1)[0][:2],
                               [[1.5, 0.0, 0.0, 0.0], [1.1, 1.2, 0.0, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(m2po_weights(OLD, SAMPLER, MASK, 1.0)[0][:2],
                               [[1.5, 0.5, 4.0, 0.0], [1.1, 1.2, 0.0, 0.0]], rtol=1e-6)
    # Below any suffix mean: only the smallest stays (the paper's loop stops at one token).
    np.testing.assert_allclose(m2po_weights(OLD, SAMPLER, MASK, 1e-3)[0][:2],
                               [[0.0, 0.0, 0.0, 0.0], [1.1, 0.0, 0.0, 0.0]], rtol=1e-6)
    # "Below" is strict: a suffix mean equal to the threshold does not stop the dropping.
    log_r = np.log(np.array([[2.0, 2.0, 2.0]]))
    equal = m2po_weights(log_r, np.zeros((1, 3)), np.ones((1, 3), bool), float(np.log(2.0) ** 2) * (1 + 1e-6))
    assert not np.any(equal[1])
    equal = m2po_weights(log_r, np.zeros((1, 3)), np.ones((1, 3), bool), float(np.float32(np.log(2.0)) ** 2))
    assert int(np.sum(equal[1])) == 2  # ties: all equal, all at the threshold, one is left
    assert not np.any(m2po_weights(OLD, SAMPLER, np.zeros_like(MASK), 0.04)[1])  # no loss token


def m2po_paper_mask(log_rho, mask, tau):
    """M2PO's Algorithm 1 as a loop: drop the largest (log rho)^2 until the mean of the rest is
    below tau, keeping at least one token."""
    values = log_rho[mask] ** 2
    order = np.argsort(-values, kind="stable")
    dropped = 0
    while dropped < len(values) - 1 and values[order[dropped:]].mean() >= tau:
        dropped += 1
    keep = np.ones(len(values), bool)
    keep[order[:dropped]] = False
    out = np.zeros(mask.shape, bool)
    out[mask] = keep
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_m2po_mask_is_the_papers_loop(seed):
    rng = np.random.default_rng(seed)
    mask = rng.random((6, 9)) < 0.7
    log_rho = rng.normal(0.0, 0.6, (6, 9)) * (rng.random((6, 9)) < 0.4)  # most tokens at 0
    old = np.full((6, 9), -1.5)
    weights, zeroed = m2po_weights(old, old - log_rho, mask, 0.04)
    kept = m2po_paper_mask(log_rho, mask, 0.04)
    assert 0 < zeroed.sum() < mask.sum()
    np.testing.assert_array_equal(zeroed, mask & ~kept)
    np.testing.assert_allclose(weights, np.where(kept, np.exp(log_rho), 0.0), rtol=1e-5)
    assert np.mean(log_rho[kept] ** 2) < 0.04


# --- the rules inside the loss: each source's objective, written out from its formula ------------

def areal_ppo_actor_loss(logprobs, proximal_logprobs, old_logprobs, advantages, loss_mask,
                         eps_clip, eps_clip_higher, behav_imp_weight_cap):
    """AReaL's ``ppo_actor_loss_fn`` with ``use_decoupled_loss`` (``areal/utils/functional.py``):
    token ratio to the proximal policy, clipped; the behaviour weight exp(proximal - old) where it
    is <= the cap, 0 where above; the sum over the loss mask divided by its full count."""
    ratio = jnp.where(loss_mask, jnp.exp(logprobs - proximal_logprobs), 0)
    clipped = jnp.clip(ratio, 1.0 - eps_clip, 1.0 + eps_clip_higher)
    pg_loss = jnp.maximum(-advantages * ratio, -advantages * clipped)
    behav_imp_weight = jnp.exp(proximal_logprobs - old_logprobs)
    behav_mask = (behav_imp_weight <= behav_imp_weight_cap) & loss_mask
    pg_loss = pg_loss * jnp.where(behav_mask, behav_imp_weight, 0.0)
    return jnp.where(loss_mask, pg_loss, 0).sum() / jnp.count_nonzero(loss_mask)


def test_the_areal_rule_is_areals_decoupled_ppo_loss():
    # A stale batch: ratios to the behaviour policy up to e^1, several above the cap 1.5; and a
    # policy moved from the proximal one, so that the clip acts on some tokens.
    logp, old, sampler, adv, mask = batch(11)
    correction = RolloutCorrection(weights="token", weight_rule="areal", weight_cap=1.5)
    advantages, kept, _ = apply_correction(correction, adv, old, sampler, mask)

    def ours(lp):
        loss_sum, count, _ = policy_loss(lp, old, advantages, kept, 0.2, 0.28)
        return loss_sum / count

    def areal(lp):
        return areal_ppo_actor_loss(lp, old, sampler, adv[:, None], mask, 0.2, 0.28, 1.5)

    over = np.asarray(mask) & (np.exp(np.asarray(old - sampler)) > 1.5)
    ratio = np.exp(np.asarray(logp - old))
    assert over.sum() >= 5 and np.any(np.asarray(mask) & ((ratio < 0.8) | (ratio > 1.28)))
    assert float(ours(logp)) == pytest.approx(float(areal(logp)), rel=1e-5)
    np.testing.assert_allclose(jax.grad(ours)(logp), jax.grad(areal)(logp), rtol=1e-5, atol=1e-8)
    # Today's truncation gives those tokens the weight C instead, and the token mask drops them
    # from the count: AReaL's loss times N_all / N_kept.
    tis, _, _ = apply_correction(RolloutCorrection(weights="token", weight_cap=1.5), adv, old, sampler, mask)
    assert float(policy_loss(logp, old, tis, mask)[0] / policy_loss(logp, old, tis, mask)[1]) != pytest.approx(
        float(areal(logp)), rel=1e-3)
    masked = RolloutCorrection(weights="token", weight_cap=1e3, mask="token", mask_low=1e-8, mask_high=1.5)
    masked_adv, masked_mask, _ = apply_correction(masked, adv, old, sampler, mask)
    loss_sum, count, _ = policy_loss(logp, old, masked_adv, masked_mask)
    n_all, n_kept = int(np.asarray(mask).sum()), int(np.asarray(masked_mask).sum())
    assert float(loss_sum / count) == pytest.approx(float(areal(logp)) * n_all / n_kept, rel=1e-5)


def test_the_icepop_rule_is_icepops_objective():
    # IcePop: 1/G sum_i 1/|y_i| sum_t M(k_t) min(r A, clip(r) A), M(k) = k on [alpha, beta].
    logp, old, sampler, adv, mask = batch(12)
    correction = RolloutCorrection(weights="token", weight_rule="icepop", weight_floor=0.5, weight_cap=2.0)
    advantages, kept, _ = apply_correction(correction, adv, old, sampler, mask)
    k = np.exp(np.asarray(old - sampler, np.float64))
    m = np.where((k >= 0.5) & (k <= 2.0), k, 0.0)
    ratio = np.exp(np.asarray(logp - old, np.float64))
    a = np.asarray(adv, np.float64)[:, None]
    objective = m * np.minimum(ratio * a, np.clip(ratio, 0.8, 1.28) * a)
    mask_np = np.asarray(mask)
    assert np.any(mask_np & (m == 0) & (k < 0.5)) and np.any(mask_np & (m == 0) & (k > 2.0))
    expected = -np.mean((objective * mask_np).sum(-1) / mask_np.sum(-1))
    loss_sum, count, _ = policy_loss(logp, old, advantages, kept, loss_agg_mode="seq-mean-token-mean")
    assert float(loss_sum / count) == pytest.approx(expected, rel=1e-5)


def test_the_m2po_rule_is_m2pos_objective_at_the_steps_params():
    # M2PO: 1 / sum|o_i| sum M_t pi_theta / pi_behav A. At the step's params pi_theta = pi_prox,
    # so pi_theta / pi_behav = rho: value and gradient of the clipped loss with M2PO's weights.
    _, old, sampler, adv, mask = batch(13)
    correction = RolloutCorrection(weights="token", weight_rule="m2po", m2_threshold=0.04)
    advantages, kept, metrics = apply_correction(correction, adv, old, sampler, mask)
    mask_np = np.asarray(mask)
    keep = m2po_paper_mask(np.asarray(old - sampler, np.float64), mask_np, 0.04)
    assert 0 < float(metrics["rollout_correction/zeroed_frac"]) < 1

    def m2po(lp):
        r = jnp.exp(lp - sampler)  # pi_theta / pi_behav
        return -jnp.sum(jnp.where(keep, r * adv[:, None], 0.0)) / mask_np.sum()

    def ours(lp):
        loss_sum, count, _ = policy_loss(lp, old, advantages, kept)
        return loss_sum / count

    assert float(ours(old)) == pytest.approx(float(m2po(old)), rel=1e-5)
    np.testing.assert_allclose(jax.grad(ours)(old), jax.grad(m2po)(old), rtol=1e-5, atol=1e-8)


# --- what the losses receive: verl's weighting, exactly ------------------------------------------

def batch(seed):
    k1, k2, k3, k4, k5 = jax.random.split(jax.random.key(seed), 5)
    old = -jax.random.uniform(k1, (5, 6), minval=0.1, maxval=3.0)
    logp = old + jax.random.uniform(k2, (5, 6), minval=-0.5, maxval=0.5)
    sampler = old + jax.random.uniform(k5, (5, 6), minval=-1.0, maxval=1.0)
    adv = jax.random.normal(k3, (5,))
    mask = jax.random.bernoulli(k4, 0.8, (5, 6)).at[:, 0].set(True)
    return logp, old, sampler, adv, mask


def verl_matrix(name, logp, old, adv):
    """verl's per-token loss matrices (clipped surrogate: 0.2 / 0.28, no dual clip)."""
    ratio = np.exp(logp - old)
    if name == "policy":
        return np.maximum(-adv * ratio, -adv * np.clip(ratio, 0.8, 1.28))
    if name == "cispo":
        return -np.clip(ratio, 0.0, 1.28) * adv * logp
    if name == "gpg":
        return -adv * logp
    tau = np.where(adv > 0, 1.0, 1.05)
    return -(1 / (1 + np.exp(-tau * (ratio - 1)))) * 4 / tau * adv


LOSSES = {"policy": (policy_loss, "token-mean"), "cispo": (cispo_loss, "token-mean"),
          "gpg": (gpg_loss, "token-mean"), "sapo": (sapo_loss, "seq-mean-token-mean")}


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_weighted_advantages_are_verls_weighted_token_losses(name, level):
    # verl multiplies each token's loss by its (constant) weight and zeroes the rejected tokens'
    # response_mask; the correction here hands the loss A * w and the narrowed mask instead.
    logp, old, sampler, adv, mask = batch(3)
    correction = RolloutCorrection(weights=level, weight_cap=1.5, mask="token", mask_low=0.5, mask_high=2.2)
    advantages, kept, _ = apply_correction(correction, adv, old, sampler, mask)
    loss, mode = LOSSES[name]
    loss_sum, count, _ = loss(logp, old, advantages, kept, loss_agg_mode=mode)

    w = np.asarray(importance_weights(old, sampler, mask, level, 1.5)[0], np.float64)
    kept_np = np.asarray(kept)
    assert 0 < kept_np.sum() < np.asarray(mask).sum()  # the mask dropped some tokens
    mat = verl_matrix(name, *(np.asarray(x, np.float64) for x in (logp, old)),
                      np.asarray(adv, np.float64)[:, None]) * w
    if mode == "token-mean":
        expected = (mat * kept_np).sum() / kept_np.sum()
    else:
        rows = kept_np.any(-1)
        expected = ((mat * kept_np).sum(-1)[rows] / kept_np.sum(-1)[rows]).mean()
    assert float(loss_sum) / int(count) == pytest.approx(expected, rel=1e-5)


def test_weighted_clipped_surrogate_gradient_closed_form():
    # d/dlogp of w * max(-r A, -clip(r) A) is -w A r where the unclipped branch is active, 0
    # where the clipped one is; weights are constants (no gradient through the sampler's or the
    # old log-probs), and the token mean is over the kept tokens.
    logp, old, sampler, adv, mask = batch(5)
    correction = RolloutCorrection(weights="token", weight_cap=1.5, mask="token", mask_low=0.5, mask_high=2.2)
    advantages, kept, _ = apply_correction(correction, adv, old, sampler, mask)

    def mean(lp):
        loss_sum, count, _ = policy_loss(lp, old, advantages, kept)
        return loss_sum / count

    grad = np.asarray(jax.grad(mean)(logp))
    ratio = np.exp(np.asarray(logp - old))
    a = np.asarray(adv)[:, None]
    w = np.minimum(np.exp(np.asarray(old - sampler)), 1.5)
    active = ((a > 0) & (ratio < 1.28)) | ((a < 0) & (ratio > 0.8))
    kept = np.asarray(kept)
    expected = np.where(kept & active, -w * a * ratio / kept.sum(), 0.0)
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-8)
    # The weights do not depend on logp: the gradient through old_logp and sampler_logp is 0.
    g_old = jax.grad(lambda o: policy_loss(logp, o, apply_correction(correction, adv, o, sampler, mask)[0],
                                           kept)[0])(old)
    g_sampler = jax.grad(lambda s: policy_loss(logp, old, apply_correction(correction, adv, old, s, mask)[0],
                                               kept)[0])(sampler)
    assert np.all(np.asarray(g_old) == 0.0) and np.all(np.asarray(g_sampler) == 0.0)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_sequence_losses_take_the_weighted_advantages_mean(level):
    # GSPO and GMPO average a sequence's per-token advantages: with sequence-level weights that
    # is A_i * w_i, exactly the sequence loss times its weight (verl's GMPO weighting); with
    # token weights it is A_i * mean_t w_t.
    from rstar2_jax.algorithms import gmpo_loss, gspo_loss

    logp, old, sampler, adv, mask = batch(9)
    correction = RolloutCorrection(weights=level, weight_cap=1.5)
    advantages, kept, _ = apply_correction(correction, adv, old, sampler, mask)
    w = np.asarray(importance_weights(old, sampler, mask, level, 1.5)[0])
    m = np.asarray(mask)
    seq_w = (w * m).sum(-1) / m.sum(-1)
    for loss in (gspo_loss, functools.partial(gmpo_loss)):
        got = loss(logp, old, advantages, kept)[0]
        expected = loss(logp, old, adv * seq_w, mask)[0]
        np.testing.assert_allclose(got, expected, rtol=1e-5)
