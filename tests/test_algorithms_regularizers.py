"""The entropy bonus and the KL penalty to a reference (`regularized`, `kl_penalty`): closed
forms on small arrays, verl's formulas, gradients, every aggregation mode, exact accumulation,
masking, the inputs a wrapped loss declares, and the loss contract's extra inputs."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loss_batches import random_batch
from rstar2_jax.algorithms import (
    ALGORITHMS,
    KL_PENALTIES,
    gmpo_loss,
    gspo_loss,
    kl_penalty,
    loss_aggregation,
    loss_inputs,
    policy_loss,
    regularized,
)

AGG_MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def verl_kl_penalty(logprob, ref_logprob, kind):
    """verl's ``kl_penalty_forward`` (verl/trainer/ppo/core_algos.py), transcribed to numpy."""
    if kind == "k1":
        return logprob - ref_logprob
    if kind == "abs":
        return np.abs(logprob - ref_logprob)
    if kind in ("mse", "k2"):
        return 0.5 * np.square(logprob - ref_logprob)
    kl = np.clip(ref_logprob - logprob, -20, 20)
    return np.clip(np.exp(kl) - kl - 1, -10, 10)


# d = logp - ref = [1, -1, 0, -30, 30]
LOGP = np.array([-1.0, -2.0, -0.5, -31.0, -0.5])
REF = np.array([-2.0, -1.0, -0.5, -1.0, -30.5])


@pytest.mark.parametrize("kind, expected", [
    ("k1", [1.0, -1.0, 0.0, -30.0, 30.0]),
    ("k2", [0.5, 0.5, 0.0, 450.0, 450.0]),
    ("mse", [0.5, 0.5, 0.0, 450.0, 450.0]),
    ("abs", [1.0, 1.0, 0.0, 30.0, 30.0]),
    # e^-d + d - 1; -d clamped to [-20, 20], then at most 10
    ("k3", [np.exp(-1.0), np.e - 2, 0.0, 10.0, 10.0]),
    ("low_var_kl", [np.exp(-1.0), np.e - 2, 0.0, 10.0, 10.0]),
])
def test_kl_penalty_closed_forms_and_verl(kind, expected):
    got = np.asarray(kl_penalty(jnp.asarray(LOGP), jnp.asarray(REF), kind))
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(got, verl_kl_penalty(LOGP, REF, kind), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind, grad", [
    ("k1", lambda d: np.ones_like(d)),
    ("k2", lambda d: d),
    ("k3", lambda d: 1 - np.exp(-d)),
    ("abs", np.sign),
])
def test_kl_penalty_gradients_flow_into_the_policy_only(kind, grad):
    logp, ref = jnp.array([-1.0, -2.0, -0.7]), jnp.array([-2.0, -1.0, -0.5])
    g_logp, g_ref = jax.grad(lambda lp, r: jnp.sum(kl_penalty(lp, r, kind)), argnums=(0, 1))(logp, ref)
    np.testing.assert_allclose(g_logp, grad(np.asarray(logp - ref)), rtol=1e-6)
    assert not np.any(np.asarray(g_ref))


def test_every_kl_penalty_is_zero_at_the_reference_and_unknown_ones_raise():
    x = jnp.array([-1.0, -3.0])
    for kind in KL_PENALTIES:
        assert not np.any(np.asarray(kl_penalty(x, x, kind))), kind
    with pytest.raises(ValueError, match="kl_penalty must be one of"):
        kl_penalty(x, x, "full")


# Two rows and a padding row; loss tokens 2 + 1. Entropy 1, 2 | 4; logp - ref = 1, -1 | 0.
MASK = jnp.array([[1, 1, 0], [1, 0, 0], [0, 0, 0]], bool)
ENTROPY = jnp.array([[1.0, 2.0, 9.0], [4.0, 9.0, 9.0], [9.0, 9.0, 9.0]])
LOGPROBS = jnp.array([[-1.0, -2.0, -1.0], [-0.5, -1.0, -1.0], [-1.0, -1.0, -1.0]])
REFS = jnp.array([[-2.0, -1.0, -5.0], [-0.5, -5.0, -5.0], [-5.0, -5.0, -5.0]])
K3 = [np.exp(-1.0), np.e - 2]  # of row 0's tokens; row 1's is 0


# The terms' closed forms by aggregation mode: (count, entropy sum, k3 sum); L = the 3 columns.
BY_MODE = {"token-mean": (3, 1 + 2 + 4, K3[0] + K3[1]),
           "seq-mean-token-mean": (2, (1 + 2) / 2 + 4, (K3[0] + K3[1]) / 2),
           "seq-mean-token-sum": (2, 1 + 2 + 4, K3[0] + K3[1]),
           "seq-mean-token-sum-norm": (2, (1 + 2 + 4) / 3, (K3[0] + K3[1]) / 3)}


@pytest.mark.parametrize("name", sorted(ALGORITHMS))  # every aggregation mode among them
def test_every_named_algorithm_takes_both_terms_aggregated_as_its_loss_is(name):
    loss = ALGORITHMS[name].loss
    mode, _ = loss_aggregation(loss)
    count, entropy_sum, kl_sum = BY_MODE[mode]
    advantages = jnp.array([1.0, -1.0, 0.0])
    base, base_count, base_metrics = loss(LOGPROBS, LOGPROBS, advantages, MASK)
    wrapped = regularized(loss, entropy_coef=0.1, kl_coef=0.5, kl_penalty="k3")
    loss_sum, n, metrics = wrapped(LOGPROBS, LOGPROBS, advantages, MASK, entropy=ENTROPY, ref_logp=REFS)
    assert int(n) == int(base_count) == count
    assert float(loss_sum) == pytest.approx(float(base) - 0.1 * entropy_sum + 0.5 * kl_sum, rel=1e-6)
    assert float(metrics["entropy_loss"]) == pytest.approx(entropy_sum, rel=1e-6)
    assert float(metrics["kl_loss"]) == pytest.approx(kl_sum, rel=1e-6)
    assert {k: float(v) for k, v in metrics.items() if k in base_metrics} == pytest.approx(
        {k: float(v) for k, v in base_metrics.items()})


def test_gradients_of_the_terms():
    # Token mean over 3 tokens: d/dH_t = -c_e / 3; d/dlogp_t of the k1 term = c_k / 3.
    advantages = jnp.zeros(3)  # the surrogate adds no gradient
    wrapped = regularized(policy_loss, entropy_coef=0.1, kl_coef=0.5, kl_penalty="k1")

    def mean_loss(logp, entropy):
        loss_sum, count, _ = wrapped(logp, LOGPROBS, advantages, MASK, entropy=entropy, ref_logp=REFS)
        return loss_sum / count

    g_logp, g_entropy = jax.grad(mean_loss, argnums=(0, 1))(LOGPROBS, ENTROPY)
    np.testing.assert_allclose(g_entropy, np.where(MASK, -0.1 / 3, 0.0), rtol=1e-6)
    np.testing.assert_allclose(g_logp, np.where(MASK, 0.5 / 3, 0.0), rtol=1e-6)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batch_accumulation_stays_exact(mode):
    logp, old, adv, mask = random_batch(3, batch=6, seq=7, ratio_spread=0.6)
    mask = mask.at[4].set(False)
    entropy = jax.random.uniform(jax.random.key(1), logp.shape, maxval=3.0)
    ref = old - jax.random.uniform(jax.random.key(2), logp.shape, maxval=0.5)
    loss = regularized(functools.partial(policy_loss, loss_agg_mode=mode, norm_length=7),
                       entropy_coef=0.05, kl_coef=0.2)

    def full(lp, h):
        s, c, _ = loss(lp, old, adv, mask, entropy=h, ref_logp=ref)
        return s / c

    def split(lp, h):
        parts = [loss(lp[s], old[s], adv[s], mask[s], entropy=h[s], ref_logp=ref[s])
                 for s in (slice(0, 1), slice(1, 4), slice(4, 6))]
        return sum(p[0] for p in parts) / sum(p[1] for p in parts)

    for a, b in zip(jax.value_and_grad(full, argnums=(0, 1))(logp, entropy),
                    jax.value_and_grad(split, argnums=(0, 1))(logp, entropy)):
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("garbage", [np.inf, -np.inf, np.nan, 1e30])
def test_garbage_at_masked_positions_changes_nothing(garbage):
    logp, old, adv, mask = random_batch(4)
    entropy = jnp.ones(logp.shape)
    ref = old - 0.3
    loss = regularized(policy_loss, entropy_coef=0.05, kl_coef=0.2)

    def value_and_grads(h, r):
        return jax.value_and_grad(lambda lp, h: loss(lp, old, adv, mask, entropy=h, ref_logp=r)[0],
                                  argnums=(0, 1))(logp, h)

    clean = value_and_grads(entropy, ref)
    dirty = value_and_grads(jnp.where(mask, entropy, garbage), jnp.where(mask, ref, garbage))
    for a, b in zip(jax.tree.leaves(clean), jax.tree.leaves(dirty)):
        np.testing.assert_array_equal(a, b)


def test_off_is_the_loss_itself_and_the_wrapper_declares_what_it_needs():
    assert regularized(policy_loss) is policy_loss
    assert loss_inputs(policy_loss) == ()
    assert loss_inputs(regularized(policy_loss, entropy_coef=0.1)) == ("entropy",)
    assert loss_inputs(regularized(policy_loss, kl_coef=0.1)) == ("ref_logp",)

    def own(logp, old_logp, advantages, mask, *, ref_logp, loss_agg_mode="token-mean"):
        return policy_loss(logp + 0 * ref_logp, old_logp, advantages, mask)

    both = regularized(own, entropy_coef=0.1)
    assert loss_inputs(both) == ("entropy", "ref_logp")  # its own input passes through
    s, c, m = both(LOGPROBS, LOGPROBS, jnp.zeros(3), MASK, entropy=ENTROPY, ref_logp=REFS)
    assert float(m["entropy_loss"]) == pytest.approx(7.0) and int(c) == 3


def test_every_named_algorithm_declares_its_aggregation():
    for name, algorithm in ALGORITHMS.items():
        assert loss_aggregation(algorithm.loss) is not None, name
    assert loss_aggregation(gspo_loss) == loss_aggregation(gmpo_loss) == ("seq-mean-token-mean", None)
    with pytest.raises(ValueError, match="mean over sequences"):
        gspo_loss(LOGPROBS, LOGPROBS, jnp.zeros(3), MASK, loss_agg_mode="token-mean")


def test_a_sequence_level_loss_gets_its_terms_as_means_over_sequences():
    wrapped = regularized(gspo_loss, entropy_coef=1.0)
    base, _, _ = gspo_loss(LOGPROBS, LOGPROBS, jnp.zeros(3), MASK)
    loss_sum, count, _ = wrapped(LOGPROBS, LOGPROBS, jnp.zeros(3), MASK, entropy=ENTROPY)
    assert int(count) == 2 and float(loss_sum - base) == pytest.approx(-((1 + 2) / 2 + 4))


def test_bad_settings_raise():
    def undeclared(logp, old_logp, advantages, mask):
        return policy_loss(logp, old_logp, advantages, mask)

    with pytest.raises(ValueError, match="declares no loss_agg_mode"):
        regularized(undeclared, entropy_coef=0.1)
    assert regularized(undeclared) is undeclared  # nothing to add, nothing to know
    with pytest.raises(ValueError, match=">= 0"):
        regularized(policy_loss, entropy_coef=-0.1)
    with pytest.raises(ValueError, match="kl_penalty must be one of"):
        regularized(policy_loss, kl_coef=0.1, kl_penalty="k4")
