"""CISPO, GPG and SAPO: closed forms of values and gradients, exact accumulation over
micro-batches, masked garbage, and values against references written here from verl's
formulas (``core_algos.compute_policy_loss_{cispo,gpg,sapo}`` and ``agg_loss``)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loss_batches import random_batch
from rstar2_jax.algorithms import cispo_loss, gpg_loss, sapo_loss

LOSSES = {"cispo": cispo_loss, "gpg": gpg_loss, "sapo": sapo_loss}


def tokens(ratios, advantages, old=-1.0):
    """One row per token: logp = old + log(ratio), advantage as given, all loss tokens."""
    old_logp = jnp.full((len(ratios), 1), old)
    return old_logp + jnp.log(jnp.array(ratios))[:, None], old_logp, jnp.array(advantages), jnp.ones((len(ratios), 1))


def mean(loss, logp, old, adv, mask, **kwargs):
    loss_sum, count, _ = loss(logp, old, adv, mask, **kwargs)
    return loss_sum / count


def test_cispo_clips_the_weight_and_keeps_every_gradient():
    # Ratios 1.5 (A = 1: weight capped at 1.28), 0.5 (A = 1: no lower bound by default, 0.5),
    # 1.0 (A = -1: weight 1). l = -w A logp, token mean over 3; d/dlogp = -w A / 3, where the
    # clipped surrogate would give token 0 no gradient at all.
    logp, old, adv, mask = tokens([1.5, 0.5, 1.0], [1.0, 1.0, -1.0])
    weights = np.array([1.28, 0.5, 1.0])
    value, grad = jax.value_and_grad(functools.partial(mean, cispo_loss))(logp, old, adv, mask)
    assert float(value) == pytest.approx(np.sum(-weights * np.asarray(adv) * np.asarray(logp)[:, 0]) / 3, rel=1e-6)
    np.testing.assert_allclose(grad[:, 0], -weights * np.asarray(adv) / 3, rtol=1e-6)
    _, count, sums = cispo_loss(logp, old, adv, mask)
    assert float(sums["clip_high_frac"]) / int(count) == pytest.approx(1 / 3)
    assert float(sums["clip_low_frac"]) == 0.0
    # With a lower bound 1 - 0.2 the ratio 0.5 weighs 0.8.
    grad = jax.grad(functools.partial(mean, cispo_loss, eps_low=0.2))(logp, old, adv, mask)
    np.testing.assert_allclose(grad[:, 0], -np.array([1.28, 0.8, 1.0]) * np.asarray(adv) / 3, rtol=1e-6)


def test_gpg_is_the_plain_policy_gradient():
    logp, old, adv, mask = tokens([3.0, 0.2, 1.0], [2.0, -1.0, 0.5])
    value, grad = jax.value_and_grad(functools.partial(mean, gpg_loss))(logp, old, adv, mask)
    assert float(value) == pytest.approx(float(jnp.sum(-adv * logp[:, 0])) / 3, rel=1e-6)
    np.testing.assert_allclose(grad[:, 0], -np.asarray(adv) / 3, rtol=1e-6)  # no ratio, no clip


@pytest.mark.parametrize("ratio, advantage", [(1.0, 1.0), (1.0, -2.0), (1.6, 1.0), (0.4, -1.0), (3.0, -0.5)])
def test_sapo_gate_value_and_slope(ratio, advantage):
    # f(r) = sigmoid(tau (r - 1)) 4 / tau with tau 1.0 for A > 0, 1.05 for A < 0; l = -f(r) A;
    # d l / d logp = -A 4 s (1 - s) r with s = sigmoid(tau (r - 1)): -A exactly at r = 1.
    tau = 1.0 if advantage > 0 else 1.05
    s = 1 / (1 + np.exp(-tau * (ratio - 1)))
    logp, old, adv, mask = tokens([ratio], [advantage])
    value, grad = jax.value_and_grad(functools.partial(mean, sapo_loss))(logp, old, adv, mask)
    assert float(value) == pytest.approx(-s * 4 / tau * advantage, rel=1e-5)
    assert float(grad[0, 0]) == pytest.approx(-advantage * 4 * s * (1 - s) * ratio, rel=1e-5)
    if ratio == 1.0:
        assert float(grad[0, 0]) == pytest.approx(-advantage, rel=1e-6)


def test_sapo_averages_per_sequence_then_over_sequences():
    # On policy each token's loss is -f(1) A = -2 A / tau (tau = 1 for A > 0): rows of 1 and 3
    # tokens with A = 1 and 2 give the mean over the two sequences of their token means,
    # (-2 - 4) / 2, whatever their lengths.
    mask = jnp.array([[1, 0, 0], [1, 1, 1], [0, 0, 0]])
    logp = jnp.full((3, 3), -0.5)
    loss_sum, count, _ = sapo_loss(logp, logp, jnp.array([1.0, 2.0, 9.0]), mask)
    assert int(count) == 2 and float(loss_sum) / 2 == pytest.approx(-3.0, rel=1e-6)


@pytest.mark.parametrize("name", LOSSES)
def test_micro_batches_accumulate_exactly_and_masked_values_are_ignored(name):
    loss = LOSSES[name]
    logp, old, adv, mask = random_batch(1, batch=6, seq=7, ratio_spread=0.5)
    mask = mask.at[4].set(False)
    full = jax.value_and_grad(functools.partial(mean, loss))(logp, old, adv, mask)

    def split(lp):
        parts = [loss(lp[s], old[s], adv[s], mask[s]) for s in (slice(0, 1), slice(1, 4), slice(4, 6))]
        return sum(p[0] for p in parts) / sum(p[1] for p in parts)

    accumulated = jax.value_and_grad(split)(logp)
    np.testing.assert_allclose(accumulated[0], full[0], rtol=1e-6)
    np.testing.assert_allclose(accumulated[1], full[1], rtol=1e-6, atol=1e-9)
    adv_tokens = jnp.broadcast_to(adv[:, None], mask.shape)
    noisy = [jnp.where(mask, x, jnp.nan) for x in (logp, old, adv_tokens)]
    dirty = jax.value_and_grad(functools.partial(mean, loss))(*noisy, mask)
    np.testing.assert_array_equal(dirty[0], full[0])
    np.testing.assert_array_equal(dirty[1], full[1])
    # Off-policy ratio metrics of the step: approx_kl > 0, ratio_max > 1.
    _, count, sums = loss(logp, old, adv, mask)
    assert float(sums["approx_kl"]) > 0 and float(sums["ratio_max"]) > 1


# --- verl's formulas, written here in numpy (float64) -----------------------------------------

def agg(loss_mat, mask, mode):
    """verl's ``agg_loss`` on one micro-batch (dp 1): the value it backpropagates."""
    mask = mask.astype(np.float64)
    if mode == "token-mean":
        return (loss_mat * mask).sum() / mask.sum()
    seq_tokens = mask.sum(-1)
    if mode == "seq-mean-token-mean":
        seq = (loss_mat * mask).sum(-1) / (seq_tokens + 1e-8)
    else:
        seq = (loss_mat * mask).sum(-1)
    if mode == "seq-mean-token-sum-norm":
        return seq.sum() / mask.shape[-1]
    valid = seq_tokens > 0
    return seq[valid].sum() / valid.sum()


def verl_loss_matrix(name, logp, old, adv, weights):
    """The per-token loss matrices of verl's cispo / gpg / sapo (ratio from clamp(log r, +-20)),
    times the rollout-correction weights as verl multiplies them in."""
    ratio = np.exp(np.clip(logp - old, -20, 20))
    if name == "cispo":
        mat = -np.clip(ratio, 1 - 1.0, 1 + 0.28) * adv * logp
    elif name == "gpg":
        mat = -logp * adv
    else:
        tau = np.where(adv > 0, 1.0, 1.05)
        mat = -(1 / (1 + np.exp(-tau * (ratio - 1)))) * (4 / tau) * adv
    return mat * weights


@pytest.mark.parametrize("name, mode", [("cispo", "token-mean"), ("gpg", "token-mean"),
                                        ("sapo", "seq-mean-token-mean"), ("gpg", "seq-mean-token-sum"),
                                        ("cispo", "seq-mean-token-sum-norm")])
def test_values_match_verls_formulas(name, mode):
    logp, old, adv, mask = (np.asarray(x, np.float64) for x in random_batch(7, batch=5, seq=7, ratio_spread=0.6))
    mask = mask.astype(bool)
    adv_tokens = np.broadcast_to(adv[:, None], mask.shape)
    expected = agg(verl_loss_matrix(name, logp, old, adv_tokens, 1.0), mask, mode)
    loss_sum, count, _ = LOSSES[name](*(jnp.asarray(x, jnp.float32) for x in (logp, old, adv)), mask,
                                      loss_agg_mode=mode)
    # verl's seq-mean-token-sum-norm is not divided by the sequences; here it is (the docstring).
    got = float(loss_sum) if mode == "seq-mean-token-sum-norm" else float(loss_sum) / int(count)
    assert got == pytest.approx(expected, rel=1e-5)
