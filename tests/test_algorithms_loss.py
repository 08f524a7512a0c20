"""The clipped surrogate (`policy_loss`): closed forms, gradients, the aggregation modes,
accumulation, masking."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loss_batches import random_batch
from rstar2_jax.algorithms import policy_loss

EPS_LOW, EPS_HIGH = 0.2, 0.28
AGG_MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def one_token(ratio, advantage, **kwargs):
    """Loss of a single loss token with the given probability ratio."""
    old = jnp.full((1, 1), -1.0)
    return policy_loss(old + jnp.log(ratio), old, jnp.array([advantage]), jnp.ones((1, 1)), **kwargs)


@pytest.mark.parametrize(
    "ratio, advantage, expected",
    [
        (1.0, 1.0, -1.0),
        (1.1, 2.0, -2.2),  # inside the clip range: -r * A
        (1.5, 1.0, -1.28),  # A > 0 above 1 + eps_high: clipped
        (0.5, 1.0, -0.5),  # A > 0 below 1 - eps_low: not clipped (the surrogate is a min)
        (0.5, -1.0, 0.8),  # A < 0 below 1 - eps_low: clipped at 0.8
        (1.5, -1.0, 1.5),  # A < 0 above 1 + eps_high: not clipped
        (5.0, -1.0, 5.0),  # ... and unbounded without dual clip
    ],
)
def test_single_token_closed_form(ratio, advantage, expected):
    loss_sum, count, _ = one_token(ratio, advantage)
    assert float(loss_sum) == pytest.approx(expected, rel=1e-5)
    assert int(count) == 1


def test_dual_clip_caps_negative_advantage_tokens():
    assert float(one_token(5.0, -1.0, dual_clip=3.0)[0]) == pytest.approx(3.0, rel=1e-6)
    assert float(one_token(2.0, -1.0, dual_clip=3.0)[0]) == pytest.approx(2.0, rel=1e-6)
    assert float(one_token(5.0, 1.0, dual_clip=3.0)[0]) == pytest.approx(-1.28, rel=1e-6)


def mean_loss(logp, old, adv, mask, **kwargs):
    loss_sum, count, _ = policy_loss(logp, old, adv, mask, **kwargs)
    return loss_sum / count


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gradient_matches_closed_form(seed):
    logp, old, adv, mask = random_batch(seed)
    grad = jax.jit(jax.grad(mean_loss))(logp, old, adv, mask)
    ratio = np.exp(np.asarray(logp - old))
    a = np.asarray(adv)[:, None]
    # d(-r A)/d logp = -r A where the unclipped branch is active; the clipped side has no gradient.
    active = ((a > 0) & (ratio < 1 + EPS_HIGH)) | ((a < 0) & (ratio > 1 - EPS_LOW))
    expected = np.where(np.asarray(mask) & active, -a * ratio / np.sum(mask), 0.0)
    assert 0 < active[np.asarray(mask)].mean() < 1, "the batch should exercise both sides"
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-7)


def test_gradient_on_policy_is_minus_advantage_over_token_count():
    # old_logp is a constant: passing logp itself as old_logp is the on-policy loss, and the
    # gradient does not cancel through it.
    logp, _, adv, mask = random_batch(3)
    grad = jax.jit(jax.grad(lambda lp: mean_loss(lp, lp, adv, mask)))(logp)
    expected = np.where(mask, -np.asarray(adv)[:, None] / np.sum(mask), 0.0)
    np.testing.assert_allclose(grad, expected, rtol=1e-6)


def dual_clipped_loss(logp, advantage):
    loss_sum, count, _ = policy_loss(logp, jnp.zeros_like(logp), jnp.array([advantage]), jnp.ones_like(logp), dual_clip=3.0)
    return loss_sum / count


def test_dual_clip_gradient_vanishes_beyond_the_cap():
    grad = jax.jit(jax.grad(lambda lp: dual_clipped_loss(lp, -1.0)))(jnp.log(jnp.array([[4.0, 2.0]])))
    # A = -1, N = 2: ratio 4 is past the cap (no gradient); ratio 2 is not: -A r / N = 1.
    np.testing.assert_allclose(grad, [[0.0, 1.0]], rtol=1e-6)


def test_aggregation_modes_closed_form():
    # On policy (r = 1) each token's loss is -A. Row 0: one token, A = 1; row 1: three tokens,
    # A = 2; row 2: no loss token (must not count as a sequence).
    mask = jnp.array([[1, 0, 0], [1, 1, 1], [0, 0, 0]])
    logp = jnp.full((3, 3), -0.5)
    adv = jnp.array([1.0, 2.0, 5.0])
    expected = {
        "token-mean": (-7.0, 4),
        "seq-mean-token-mean": (-3.0, 2),
        "seq-mean-token-sum": (-7.0, 2),
        "seq-mean-token-sum-norm": (-7.0 / 3, 2),  # L = the rows' length, 3, by default
    }
    for mode, (loss_sum, count) in expected.items():
        got_sum, got_count, _ = policy_loss(logp, logp, adv, mask, loss_agg_mode=mode)
        assert float(got_sum) == pytest.approx(loss_sum) and int(got_count) == count, mode
    # A fixed L: (token sum / L) averaged over sequences, whatever the rows' length.
    got_sum, got_count, _ = policy_loss(logp, logp, adv, mask, loss_agg_mode="seq-mean-token-sum-norm",
                                        norm_length=10)
    assert float(got_sum) / int(got_count) == pytest.approx(-7.0 / 10 / 2)
    grad = jax.grad(lambda lp: policy_loss(lp, lp, adv, mask, loss_agg_mode="seq-mean-token-sum-norm",
                                           norm_length=10)[0] / 2)(logp)
    np.testing.assert_allclose(grad, np.where(mask, -np.asarray(adv)[:, None] / 10 / 2, 0.0), rtol=1e-6)
    with pytest.raises(ValueError, match="norm_length"):
        policy_loss(logp, logp, adv, mask, loss_agg_mode="seq-mean-token-sum-norm", norm_length=0)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batch_accumulation_equals_full_batch(mode):
    logp, old, adv, mask = random_batch(5, batch=6, seq=7, ratio_spread=0.6)
    mask = mask.at[4].set(False)  # an empty row in one micro-batch
    full = jax.jit(jax.value_and_grad(lambda lp: mean_loss(lp, old, adv, mask, loss_agg_mode=mode)))(logp)

    def split_loss(logp):
        parts = [policy_loss(logp[s], old[s], adv[s], mask[s], loss_agg_mode=mode) for s in (slice(0, 1), slice(1, 4), slice(4, 6))]
        return sum(p[0] for p in parts) / sum(p[1] for p in parts)

    accumulated = jax.jit(jax.value_and_grad(split_loss))(logp)
    np.testing.assert_allclose(accumulated[0], full[0], rtol=1e-6)
    np.testing.assert_allclose(accumulated[1], full[1], rtol=1e-6, atol=1e-9)


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from(AGG_MODES), st.sampled_from([np.inf, -np.inf, np.nan, 1e30]))
def test_masked_tokens_change_nothing(seed, mode, garbage):
    logp, old, adv, mask = random_batch(seed)
    adv_tokens = jnp.broadcast_to(adv[:, None], mask.shape)
    noisy = [jnp.where(mask, x, garbage) for x in (logp, old, adv_tokens)]
    kwargs = dict(loss_agg_mode=mode, dual_clip=3.0)
    clean = jax.value_and_grad(mean_loss)(logp, old, adv_tokens, mask, **kwargs)
    dirty = jax.value_and_grad(mean_loss)(*noisy, mask, **kwargs)
    np.testing.assert_array_equal(dirty[0], clean[0])
    np.testing.assert_array_equal(dirty[1], clean[1])
    clean_metrics, dirty_metrics = (policy_loss(*x, mask, **kwargs)[2] for x in ((logp, old, adv_tokens), noisy))
    for name in clean_metrics:
        np.testing.assert_array_equal(dirty_metrics[name], clean_metrics[name], err_msg=name)


def test_per_token_advantages_equal_broadcast_rollout_advantages():
    logp, old, adv, mask = random_batch(6)
    by_rollout = policy_loss(logp, old, adv, mask)[0]
    by_token = policy_loss(logp, old, jnp.broadcast_to(adv[:, None], logp.shape), mask)[0]
    np.testing.assert_allclose(by_token, by_rollout, rtol=1e-6)


def test_metrics_closed_form():
    # Four loss tokens, one masked: ratios 1.5 (A > 0, clipped high), 0.5 (A < 0, clipped low),
    # 1.0 and 1.0 (A > 0, not clipped). Metric sums divided by the count are token means.
    old = jnp.zeros((2, 3))
    logp = jnp.log(jnp.array([[1.5, 1.0, 9.0], [0.5, 1.0, 1.0]]))
    mask = jnp.array([[1, 1, 0], [1, 1, 0]])
    adv = jnp.array([[1.0, 1.0, 1.0], [-1.0, 1.0, 1.0]])
    _, count, sums = policy_loss(logp, old, adv, mask, dual_clip=3.0)
    assert int(count) == 4
    m = {k: float(v) if k.endswith("_max") else float(v) / 4 for k, v in sums.items()}
    assert m["clip_high_frac"] == pytest.approx(0.25)
    assert m["clip_low_frac"] == pytest.approx(0.25)
    assert m["dual_clip_frac"] == 0.0
    assert m["ratio_mean"] == pytest.approx(1.0)
    assert m["ratio_max"] == pytest.approx(1.5)
    k3 = lambda r: r - 1 - np.log(r)
    assert m["approx_kl"] == pytest.approx((k3(1.5) + k3(0.5)) / 4, rel=1e-5)


@pytest.mark.parametrize("mode, clip_high, ratio_mean", [
    # Row 0: one loss token at ratio 1.5 (A > 0: clipped high); row 1: three at ratio 1.
    ("token-mean", 1 / 4, (1.5 + 3.0) / 4),  # over the 4 tokens
    ("seq-mean-token-mean", (1 + 0) / 2, (1.5 + 1.0) / 2),  # over the 2 sequences' token means
    ("seq-mean-token-sum", (1 + 0) / 2, (1.5 + 1.0) / 2),
    ("seq-mean-token-sum-norm", (1 + 0) / 2, (1.5 + 1.0) / 2),
])
def test_metrics_are_averaged_as_the_loss_is(mode, clip_high, ratio_mean):
    # The train step divides every metric sum by the loss's count (tokens or sequences), so the
    # sums must weigh tokens the same way, or a sequence-level loss logs tokens / sequences.
    old = jnp.zeros((3, 3))
    logp = jnp.log(jnp.array([[1.5, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]))
    mask = jnp.array([[1, 0, 0], [1, 1, 1], [0, 0, 0]])  # row 2: padding
    _, count, sums = policy_loss(logp, old, jnp.array([1.0, 1.0, 1.0]), mask, loss_agg_mode=mode)
    assert float(sums["clip_high_frac"]) / int(count) == pytest.approx(clip_high)
    assert float(sums["ratio_mean"]) / int(count) == pytest.approx(ratio_mean)
    assert float(sums["ratio_max"]) == pytest.approx(1.5)


def test_no_loss_tokens_gives_zero_loss_and_metrics():
    loss_sum, count, metrics = policy_loss(jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.ones(2), jnp.zeros((2, 3)))
    assert float(loss_sum) == 0.0 and int(count) == 0
    assert all(float(v) == 0.0 for v in metrics.values())


def test_jit_and_vmap_over_micro_batches():
    batches = [random_batch(s) for s in range(3)]
    stacked = [jnp.stack(x) for x in zip(*batches)]
    loss = jax.jit(jax.vmap(policy_loss, in_axes=(0, 0, 0, 0)))
    sums, counts, metrics = loss(*stacked)
    for i, b in enumerate(batches):
        s, c, m = policy_loss(*b)
        np.testing.assert_allclose(sums[i], s, rtol=1e-6)
        assert int(counts[i]) == int(c)
        np.testing.assert_allclose(metrics["ratio_max"][i], m["ratio_max"], rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(old_logp=jnp.zeros((2, 4))), "old_logp"),
        (dict(advantages=jnp.zeros(3)), "advantages"),
        (dict(mask=jnp.ones((3, 2))), "mask"),
        (dict(logp=jnp.zeros(6), old_logp=jnp.zeros(6), mask=jnp.ones(6)), r"\[batch, seq\]"),
        (dict(loss_agg_mode="sum"), "loss_agg_mode"),
        (dict(eps_low=1.5), "eps_low"),
        (dict(dual_clip=0.5), "dual_clip"),
    ],
)
def test_bad_inputs_raise(kwargs, message):
    args = dict(logp=jnp.zeros((2, 3)), old_logp=jnp.zeros((2, 3)), advantages=jnp.zeros(2), mask=jnp.ones((2, 3)))
    with pytest.raises(ValueError, match=message):
        policy_loss(**{**args, **kwargs})
