"""Advantage estimators (GRPO's group advantages, RLOO, REINFORCE++-baseline, GPG) and the
equal-reward filter."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from rstar2_jax.algorithms import (
    Rollouts,
    gpg_advantages,
    group_advantages,
    nonuniform_group_mask,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)

EPS = 1e-6


def test_one_correct_of_four_sample_std():
    # mean 1/4, deviations 3/4 and -1/4; sample variance (9/16 + 3/16) / 3 = 1/4, std 1/2.
    adv = group_advantages(jnp.array([[1.0, 0.0, 0.0, 0.0]]))
    np.testing.assert_allclose(adv, [[0.75 / (0.5 + EPS), -0.25 / (0.5 + EPS), -0.25 / (0.5 + EPS), -0.25 / (0.5 + EPS)]], rtol=1e-6)


def test_half_correct_population_std():
    # mean 1/2, population std 1/2, so A = +-(1/2) / (1/2 + eps).
    adv = group_advantages(jnp.array([[1, 0, 0, 1]]), std="population")
    expected = 0.5 / (0.5 + EPS)
    np.testing.assert_allclose(adv, [[expected, -expected, -expected, expected]], rtol=1e-6)


def test_sample_and_population_differ_by_bessel_factor():
    rewards = jnp.array([[1.0, 0.0, 1.0, 1.0, 0.0, 0.0]])
    sample = group_advantages(rewards, eps=0.0, std="sample")
    population = group_advantages(rewards, eps=0.0, std="population")
    np.testing.assert_allclose(population / sample, np.sqrt(6 / 5), rtol=1e-6)


@pytest.mark.parametrize("value", [0.0, 1.0, 0.1, 1e-3])
def test_uniform_groups_give_exact_zeros(value):
    # 0.1 * 3 / 3 != 0.1 in floating point: the zero must not depend on the mean rounding back.
    rewards = jnp.array([[value] * 3, [1.0, 0.0, 1.0]])
    adv = group_advantages(rewards)
    assert np.all(np.asarray(adv[0]) == 0.0)
    assert np.all(np.isfinite(adv))
    assert np.all(adv[1] != 0.0)


def test_integer_rewards_give_float_advantages():
    adv = group_advantages(jnp.array([[1, 0]], dtype=jnp.int32))
    assert jnp.issubdtype(adv.dtype, jnp.floating)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="at least 2"):
        group_advantages(jnp.ones((3, 1)))
    with pytest.raises(ValueError, match="std"):
        group_advantages(jnp.ones((3, 2)), std="unbiased")
    with pytest.raises(ValueError, match="num_groups"):
        group_advantages(jnp.ones(4))
    with pytest.raises(ValueError, match="num_groups"):
        nonuniform_group_mask(jnp.ones(4))


def test_population_std_allows_single_rollout_groups():
    assert np.all(group_advantages(jnp.array([[0.3], [1.0]]), std="population") == 0.0)


def test_nonuniform_group_mask():
    rewards = jnp.array([[0, 0, 0, 0], [1, 1, 1, 1], [0, 1, 0, 0], [1, 1, 0, 1]])
    np.testing.assert_array_equal(nonuniform_group_mask(rewards), [False, False, True, True])


rewards_arrays = hnp.arrays(
    np.float32,
    st.tuples(st.just(5), st.sampled_from([2, 3, 8])),  # few shapes: each one compiles
    elements=st.sampled_from([0.0, 1.0, 0.5, -2.0, 3.25]),
)


@settings(max_examples=40, deadline=None)
@given(rewards_arrays, st.sampled_from(["sample", "population"]))
def test_advantages_sum_to_zero_and_are_shift_invariant(rewards, std):
    adv = np.asarray(group_advantages(rewards, std=std))
    keep = np.asarray(nonuniform_group_mask(rewards))
    assert adv.shape == rewards.shape and np.all(np.isfinite(adv))
    np.testing.assert_allclose(adv.sum(axis=-1), 0.0, atol=1e-5)
    assert np.all(adv[~keep] == 0.0)
    # Within a group the order of advantages is the order of rewards.
    assert np.all(np.sign(adv[keep]) == np.sign(rewards[keep] - rewards[keep].mean(-1, keepdims=True)))
    shifted = np.asarray(group_advantages(rewards + 7.0, std=std))
    np.testing.assert_allclose(shifted, adv, atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(rewards_arrays)
def test_population_advantages_have_unit_scale(rewards):
    # With eps = 0 and the population std, a non-degenerate group's advantages have mean 0 and
    # mean square exactly 1.
    adv = np.asarray(group_advantages(rewards, eps=0.0, std="population"))
    keep = np.asarray(nonuniform_group_mask(rewards))
    np.testing.assert_allclose(np.mean(adv[keep] ** 2, axis=-1), 1.0, rtol=1e-5)


def test_jit_and_vmap_match_eager():
    rewards = jax.random.bernoulli(jax.random.key(0), 0.4, (3, 5, 8)).astype(jnp.float32)
    batched = jax.jit(jax.vmap(group_advantages))(rewards)
    for i in range(rewards.shape[0]):
        np.testing.assert_allclose(batched[i], group_advantages(rewards[i]), rtol=1e-6)


# --- RLOO, REINFORCE++-baseline, GPG ------------------------------------------------------------

def kept(rewards, lengths=None):
    rewards = np.asarray(rewards, np.float32)
    lengths = np.full(rewards.shape, 10) if lengths is None else np.asarray(lengths)
    zeros = np.zeros(rewards.shape, np.int32)
    return Rollouts(rewards, lengths.astype(np.int32), zeros.astype(bool), zeros, zeros, zeros,
                    zeros, zeros, zeros + 1)


def test_rloo_is_each_reward_minus_the_mean_of_the_others():
    # Group [1, 0, 0, 0]: the correct one against 0, each wrong one against (1 + 0 + 0) / 3.
    adv = np.asarray(rloo_advantages(kept([[1, 0, 0, 0], [1, 1, 1, 1], [0.5, 0, 1, 0]])))
    np.testing.assert_allclose(adv[0], [1.0, -1 / 3, -1 / 3, -1 / 3], rtol=1e-6)
    assert np.all(adv[1] == 0.0)
    np.testing.assert_allclose(adv[2], [0.5 - 1 / 3, -0.5, 1 - 0.5 / 3, -0.5], rtol=1e-6)
    with pytest.raises(ValueError, match="at least 2"):
        rloo_advantages(kept([[1.0], [0.0]]))


def test_reinforce_pp_baseline_whitens_over_loss_tokens():
    # Centred: group 0 [0.5, -0.5] with 1 and 3 tokens, group 1 equal rewards [0, 0] with 2 and
    # 2 tokens. Token-weighted mean (0.5 - 1.5) / 8 = -1/8; unbiased variance over the 8 tokens
    # (1 * (5/8)^2 + 3 * (3/8)^2 + 4 * (1/8)^2) / 7 = (25 + 27 + 4) / 448 = 1/8.
    adv = np.asarray(reinforce_pp_baseline_advantages(kept([[1, 0], [1, 1]], [[1, 3], [2, 2]])))
    scale = 1 / np.sqrt(1 / 8 + 1e-8)
    np.testing.assert_allclose(adv, [[5 / 8 * scale, -3 / 8 * scale], [1 / 8 * scale] * 2], rtol=1e-5)
    # Whitened over tokens: token-weighted mean 0 and unbiased variance 1 (up to the 1e-8).
    tokens = np.array([[1, 3], [2, 2]])
    assert np.sum(tokens * adv) == pytest.approx(0.0, abs=1e-5)
    assert np.sum(tokens * adv**2) / 7 == pytest.approx(1.0, rel=1e-5)
    with pytest.raises(ValueError, match="at least 2"):
        reinforce_pp_baseline_advantages(kept([[1, 0]], [[1, 0]]))


def test_gpg_scales_by_the_share_of_groups_with_signal():
    # B = 12 rollouts, M = 4 in the one group of equal rewards: alpha = 12 / 8.
    adv = np.asarray(gpg_advantages(kept([[1, 0, 0, 0], [1, 1, 1, 1], [0, 1, 1, 0]])))
    np.testing.assert_allclose(adv[0], 1.5 * np.array([0.75, -0.25, -0.25, -0.25]), rtol=1e-6)
    assert np.all(adv[1] == 0.0)
    np.testing.assert_allclose(adv[2], 1.5 * np.array([-0.5, 0.5, 0.5, -0.5]), rtol=1e-6)
    # No group with signal: every advantage 0 (alpha 1, no division by zero).
    assert np.all(np.asarray(gpg_advantages(kept([[1, 1], [0, 0]]))) == 0.0)


def test_new_estimators_match_their_reference_formulas():
    # Written here from each source's formula (per-rollout loops over groups, float64), on
    # random rewards and lengths: verl's RLOO, REINFORCE++-baseline (masked whitening of the
    # token matrix) and the GPG paper's alpha.
    rng = np.random.default_rng(0)
    rewards = rng.integers(0, 2, (6, 4)).astype(np.float64)
    rewards[1] = 1.0
    lengths = rng.integers(1, 30, rewards.shape)
    r = kept(rewards, lengths)

    means = rewards.mean(axis=1, keepdims=True)
    m = rewards.shape[1]
    rloo = rewards * m / (m - 1) - means * m / (m - 1)
    np.testing.assert_allclose(rloo_advantages(r), rloo, atol=1e-6)

    token_values = np.concatenate([np.full(n, c) for n, c in zip(lengths.ravel(), (rewards - means).ravel())])
    mean, var = token_values.mean(), token_values.var(ddof=1)
    np.testing.assert_allclose(reinforce_pp_baseline_advantages(r), (rewards - means - mean) / np.sqrt(var + 1e-8),
                               rtol=1e-5, atol=1e-6)

    invalid = sum(m for row in rewards if row.min() == row.max())
    np.testing.assert_allclose(gpg_advantages(r), (rewards - means) * rewards.size / (rewards.size - invalid),
                               atol=1e-6)


@pytest.mark.parametrize("estimator", [
    lambda kept: group_advantages(kept.rewards), lambda kept: group_advantages(kept.rewards, std="population"),
    rloo_advantages, reinforce_pp_baseline_advantages, gpg_advantages])
def test_host_arrays_compute_in_numpy_as_jax_arrays_compute(estimator):
    # The trainer's call: numpy in, numpy out (nothing to compile, whatever the kept count);
    # the same values as from jax arrays, which stay jit-able.
    rng = np.random.default_rng(3)
    rewards = rng.integers(0, 2, (7, 4)).astype(np.float32)
    rewards[2] = 1.0  # a group of equal rewards
    kept = Rollouts.from_rewards(rewards, lengths=rng.integers(1, 50, rewards.shape))
    host = estimator(kept)
    assert isinstance(host, np.ndarray) and host.dtype == np.float32
    device = estimator(Rollouts(*(jnp.asarray(x) for x in kept)))
    assert isinstance(device, jax.Array)
    np.testing.assert_allclose(host, np.asarray(device), rtol=2e-6, atol=1e-7)
    assert np.all(host[2] == 0) or estimator is reinforce_pp_baseline_advantages
