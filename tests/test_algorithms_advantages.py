"""Group advantages and the equal-reward filter."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from rstar2_jax.algorithms import group_advantages, nonuniform_group_mask

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
