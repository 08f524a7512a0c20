"""GSPO and GMPO, the sequence-level losses: closed forms of values and gradients, exact
accumulation, masked garbage, and values against references written here from verl's formulas
(``core_algos.compute_policy_loss_gspo`` and ``compute_policy_loss_geo_mean``)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loss_batches import random_batch
from rstar2_jax.algorithms import gmpo_loss, gspo_loss


def test_gspo_closed_form():
    # Row 0: token log-ratios 0.1 and 0.3, so s = exp(0.2) = 1.2214 > 1 + 4e-4 with A = 1:
    # clipped, loss -(1 + 4e-4). Row 1: log-ratio 1e-4 on all three tokens, s = exp(1e-4),
    # inside the range, A = -2: loss 2 s. Row 2: padding, neither loss nor count.
    old = jnp.zeros((3, 3))
    logp = jnp.array([[0.1, 0.3, 7.0], [1e-4, 1e-4, 1e-4], [0.0, 0.0, 0.0]])
    mask = jnp.array([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    adv = jnp.array([1.0, -2.0, 5.0])
    loss_sum, count, sums = gspo_loss(logp, old, adv, mask)
    assert int(count) == 2
    assert float(loss_sum) == pytest.approx(-(1 + 4e-4) + 2 * np.exp(1e-4), rel=1e-6)
    assert float(sums["clip_high_frac"]) == 1.0 and float(sums["clip_low_frac"]) == 0.0
    assert float(sums["ratio_mean"]) == pytest.approx(np.exp(0.2) + np.exp(1e-4), rel=1e-6)
    assert float(sums["ratio_max"]) == pytest.approx(np.exp(0.2), rel=1e-6)


def test_gspo_gradient_is_sequence_level():
    # d l_i / d logp_t = -A_i s_i / |y_i| on every token of an unclipped sequence, 0 on a clipped
    # one; the loss is divided by the number of sequences.
    old = jnp.zeros((2, 4))
    logp = jnp.array([[1e-4, -1e-4, 2e-4, 0.0], [0.5, 0.5, 0.0, 0.0]])
    mask = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0]], bool)
    adv = jnp.array([0.7, 1.0])

    def mean(lp):
        loss_sum, count, _ = gspo_loss(lp, old, adv, mask)
        return loss_sum / count

    grad = np.asarray(jax.grad(mean)(logp))
    s0 = np.exp((1e-4 - 1e-4 + 2e-4) / 3)
    np.testing.assert_allclose(grad[0], [-0.7 * s0 / 3 / 2] * 3 + [0.0], rtol=1e-5)
    np.testing.assert_array_equal(grad[1], 0.0)  # s = e^0.5, A > 0: clipped


def test_gmpo_closed_form_and_gradient():
    # Row 0, A = 1: log-ratios 0.1 and 0.5; the second is above eps_high = 0.4 on the side that
    # grows the objective, so it counts as 0.4 and has no gradient: ratio exp((0.1 + 0.4) / 2),
    # loss -ratio. Row 1, A = -2: log-ratios -0.6 (clipped to -0.4), 0.2, 0.0: ratio
    # exp(-0.2 / 3), loss 2 ratio. Row 2: padding. Mean over the 2 sequences.
    old = jnp.zeros((3, 3))
    logp = jnp.array([[0.1, 0.5, 0.0], [-0.6, 0.2, 0.0], [0.0, 0.0, 0.0]])
    mask = jnp.array([[1, 1, 0], [1, 1, 1], [0, 0, 0]], bool)
    adv = jnp.array([1.0, -2.0, 3.0])
    r0, r1 = np.exp(0.25), np.exp(-0.2 / 3)

    def mean(lp):
        loss_sum, count, _ = gmpo_loss(lp, old, adv, mask)
        return loss_sum / count

    value, grad = jax.value_and_grad(mean)(logp)
    assert float(value) == pytest.approx((-r0 + 2 * r1) / 2, rel=1e-6)
    # d l_i / d logp_t = -A_i ratio_i / |y_i| on unclipped tokens, over 2 sequences.
    np.testing.assert_allclose(grad, [[-r0 / 2 / 2, 0.0, 0.0], [0.0, 2 * r1 / 3 / 2, 2 * r1 / 3 / 2],
                                      [0.0, 0.0, 0.0]], rtol=1e-5, atol=1e-9)
    _, count, sums = gmpo_loss(logp, old, adv, mask)
    assert int(count) == 2
    assert float(sums["clip_high_frac"]) == pytest.approx(1 / 2)  # row 0: 1 of 2 tokens
    assert float(sums["clip_low_frac"]) == pytest.approx(1 / 3)  # row 1: 1 of 3 tokens
    assert float(sums["ratio_mean"]) == pytest.approx(r0 + r1, rel=1e-6)
    assert float(sums["ratio_max"]) == pytest.approx(r0, rel=1e-6)


def test_gmpo_clips_only_the_side_that_grows_the_objective():
    # A > 0 with a log-ratio of -0.6: below -eps_low, but lowering it further lowers the
    # objective, so it is not clipped and keeps its gradient, -A ratio (a one-token sequence).
    logp, old = jnp.array([[-0.6]]), jnp.zeros((1, 1))
    grad = jax.grad(lambda lp: gmpo_loss(lp, old, jnp.array([1.0]), jnp.ones((1, 1)))[0])(logp)
    assert float(grad[0, 0]) == pytest.approx(-np.exp(-0.6), rel=1e-6)


@pytest.mark.parametrize("loss, spread", [(gspo_loss, 1e-3), (gmpo_loss, 0.8)], ids=["gspo", "gmpo"])
def test_micro_batches_accumulate_exactly_and_masked_values_are_ignored(loss, spread):
    logp, old, adv, mask = random_batch(8, batch=6, seq=5, ratio_spread=spread)
    mask = mask.at[3].set(False)

    def full(lp):
        s, c, _ = loss(lp, old, adv, mask)
        return s / c

    def split(lp):
        parts = [loss(lp[s], old[s], adv[s], mask[s]) for s in (slice(0, 2), slice(2, 6))]
        return sum(p[0] for p in parts) / sum(p[1] for p in parts)

    np.testing.assert_allclose(jax.grad(split)(logp), jax.grad(full)(logp), rtol=1e-6, atol=1e-9)
    noisy = [jnp.where(mask, x, jnp.nan) for x in (logp, old)]
    np.testing.assert_array_equal(loss(*noisy, adv, mask)[0], loss(logp, old, adv, mask)[0])
    np.testing.assert_array_equal(jax.grad(lambda lp: loss(lp, noisy[1], adv, mask)[0])(noisy[0]),
                                  jax.grad(lambda lp: loss(lp, old, adv, mask)[0])(logp))
    # Per-token advantages enter as their mean over the sequence's loss tokens.
    by_token = loss(logp, old, jnp.broadcast_to(adv[:, None], logp.shape), mask)[0]
    np.testing.assert_allclose(by_token, loss(logp, old, adv, mask)[0], rtol=1e-6)


def verl_gspo(logp, old, adv, mask, lo=3e-4, hi=4e-4):
    """verl's GSPO value: sequence ratio, token losses max(-A s, -A clip(s)), seq-mean-token-mean."""
    lengths = np.maximum(mask.sum(-1), 1)
    s = np.exp(np.minimum(((logp - old) * mask).sum(-1) / lengths, 10.0))[:, None]
    mat = np.maximum(-adv * s, -adv * np.clip(s, 1 - lo, 1 + hi))
    seq = (mat * mask).sum(-1) / (mask.sum(-1) + 1e-8)
    return seq[mask.any(-1)].mean()


def verl_gmpo(logp, old, adv, mask, lo=0.4, hi=0.4):
    """verl's geo_mean value (every row has a loss token here, so its mean over rows is ours)."""
    lr = logp - old
    sgn = np.sign(adv)
    lr_min = sgn * np.minimum(sgn * lr, sgn * np.clip(lr, -lo, hi))
    n = mask.sum(-1)
    ratio = np.exp((lr_min * mask).sum(-1) / (n + 1e-8))
    return np.mean(-((adv * mask).sum(-1) / (n + 1e-8)) * ratio)


@pytest.mark.parametrize("name", ["gspo", "gmpo"])
def test_values_match_verls_formulas(name):
    logp, old, adv, mask = (np.asarray(x, np.float64) for x in random_batch(11, ratio_spread=0.9))
    mask = mask.astype(bool)
    adv_tokens = np.broadcast_to(adv[:, None], mask.shape)
    spread = 1e-3 if name == "gspo" else 1.0  # GSPO's range is 3e-4 / 4e-4: some in, some out
    logp = old + (logp - old) * spread
    expected = (verl_gspo if name == "gspo" else verl_gmpo)(logp, old, adv_tokens, mask)
    loss = gspo_loss if name == "gspo" else gmpo_loss
    loss_sum, count, _ = loss(*(jnp.asarray(x, jnp.float32) for x in (logp, old, adv)), mask)
    assert float(loss_sum) / int(count) == pytest.approx(expected, rel=1e-5)
