"""Token selection: greedy, temperature, top-k, top-p."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstar2_jax.sampler.sampling import SamplingParams, sample_tokens


def _keys(seed, batch):
    return jax.random.split(jax.random.PRNGKey(seed), batch)


def test_rows_draw_with_their_own_keys():
    logits = jnp.zeros((3, 1000))  # uniform: any difference comes from the keys
    keys = _keys(0, 3)
    alone = [int(sample_tokens(keys[i:i + 1], logits[:1], SamplingParams())[0][0]) for i in range(3)]
    together = sample_tokens(keys, logits, SamplingParams())[0]
    assert list(np.asarray(together)) == alone


def _logits(seed=0, batch=4, vocab=50):
    return jax.random.normal(jax.random.PRNGKey(seed), (batch, vocab)) * 3.0


def test_greedy_is_argmax_with_log_softmax_logprob():
    logits = _logits()
    tokens, logp = sample_tokens(_keys(1, 4), logits, SamplingParams(temperature=0.0))
    np.testing.assert_array_equal(tokens, np.argmax(logits, axis=-1))
    expected = jax.nn.log_softmax(logits)[jnp.arange(4), tokens]
    np.testing.assert_allclose(logp, expected, atol=1e-6)


def test_top_k_one_and_tiny_top_p_are_greedy_at_any_temperature():
    logits = _logits(2)
    argmax = np.argmax(logits, axis=-1)
    for params in (SamplingParams(temperature=5.0, top_k=1),
                   SamplingParams(temperature=5.0, top_p=1e-6)):
        for seed in range(5):
            tokens, _ = sample_tokens(_keys(seed, 4), logits, params)
            np.testing.assert_array_equal(tokens, argmax)


def test_temperature_sampling_frequencies_follow_softmax():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    params = SamplingParams(temperature=2.0)
    keys = jax.random.split(jax.random.PRNGKey(0), 20000)
    tokens, logp = jax.vmap(lambda k: sample_tokens(k[None], logits, params))(keys)
    freq = np.bincount(np.asarray(tokens[:, 0]), minlength=4) / len(keys)
    expected = np.asarray(jax.nn.softmax(logits[0] / 2.0))
    # 20000 draws: the standard error of each frequency is below 0.0036; 4 sigma is 0.015.
    np.testing.assert_allclose(freq, expected, atol=0.015)
    # The reported log-prob is that of the temperature-scaled distribution.
    np.testing.assert_allclose(np.exp(logp[:, 0]), expected[np.asarray(tokens[:, 0])], rtol=1e-5)


def test_top_k_and_top_p_never_pick_outside_the_kept_set():
    probs = jnp.array([[0.4, 0.3, 0.2, 0.06, 0.04]])
    logits = jnp.log(probs)
    keys = jax.random.split(jax.random.PRNGKey(3), 3000)[:, None]
    top_k = jax.vmap(lambda k: sample_tokens(k, logits, SamplingParams(1.0, top_k=2))[0])(keys)
    assert set(np.unique(top_k)) == {0, 1}
    # top_p=0.85: 0.4+0.3 = 0.7 < 0.85, so token 2 is needed too; tokens 3 and 4 never appear.
    top_p = jax.vmap(lambda k: sample_tokens(k, logits, SamplingParams(1.0, top_p=0.85))[0])(keys)
    assert set(np.unique(top_p)) == {0, 1, 2}


@pytest.mark.parametrize("kwargs", [dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5),
                                    dict(top_k=-2)])
def test_bad_settings_are_rejected(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)
