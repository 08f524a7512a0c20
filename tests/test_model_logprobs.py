"""Chunked per-token log-probs agree with log_softmax(forward) and never build [B, T, V]."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers_hf import tiny_random_model
from rstar2_jax.model import forward, hidden_states, token_logprobs


def _batch(vocab):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, (2, 37)).astype(np.int32)
    targets = rng.integers(0, vocab, (2, 37)).astype(np.int32)
    mask = np.ones((2, 37), np.int32)
    mask[1, :9] = 0  # left padding
    return jnp.asarray(tokens), jnp.asarray(targets), jnp.asarray(mask)


def _reference(params, config, tokens, targets, mask, temperature):
    logp_all = jax.nn.log_softmax(forward(params, config, tokens, mask) / temperature, axis=-1)
    logp = jnp.take_along_axis(logp_all, targets[..., None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    return logp, entropy


@pytest.mark.parametrize("chunk_size", [8, 256])  # 8 does not divide 37; 256 exceeds it
def test_matches_log_softmax_of_forward(chunk_size):
    config, params = tiny_random_model("qwen2")
    tokens, targets, mask = _batch(config.vocab_size)

    logp, entropy = token_logprobs(params, config, tokens, targets, mask, chunk_size=chunk_size,
                                   temperature=0.7, return_entropy=True)
    ref_logp, ref_entropy = _reference(params, config, tokens, targets, mask, 0.7)

    real = np.asarray(mask, bool)
    assert logp.shape == entropy.shape == (2, 37)
    np.testing.assert_allclose(np.asarray(logp)[real], np.asarray(ref_logp)[real], atol=1e-5)
    np.testing.assert_allclose(np.asarray(entropy)[real], np.asarray(ref_entropy)[real], atol=1e-5)


@pytest.mark.parametrize("remat", [False, True])
@pytest.mark.parametrize("entropy_weight", [0.0, 0.3])
def test_gradient_matches_gradient_through_forward(remat, entropy_weight):
    # With an entropy term too (an entropy bonus differentiates the entropy output).
    config, params = tiny_random_model("qwen3")
    tokens, targets, mask = _batch(config.vocab_size)
    weights = mask.astype(jnp.float32)

    def chunked_loss(p):
        logp, entropy = token_logprobs(p, config, tokens, targets, mask, chunk_size=8, remat=remat,
                                       return_entropy=True)
        return jnp.sum((logp + entropy_weight * entropy) * weights)

    def reference_loss(p):
        logp, entropy = _reference(p, config, tokens, targets, mask, 1.0)
        return jnp.sum((logp + entropy_weight * entropy) * weights)

    grads = jax.grad(chunked_loss)(params)
    ref_grads = jax.grad(reference_loss)(params)
    for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def _largest_vocab_array(jaxpr, vocab) -> int:
    """Largest number of elements of any value with a trailing vocab axis, in nested jaxprs too."""
    largest = 0
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            shape = getattr(v.aval, "shape", ())
            if shape and shape[-1] == vocab:
                largest = max(largest, int(np.prod(shape)))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else [param]:
                sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
                if hasattr(sub, "eqns"):
                    largest = max(largest, _largest_vocab_array(sub, vocab))
    return largest


@pytest.mark.parametrize("entropy", [False, True])
def test_never_materialises_full_logits_forward_or_backward(entropy):
    config, params = tiny_random_model("qwen3", vocab_size=1000)
    tokens = jnp.zeros((2, 64), jnp.int32)

    def loss(p):
        out = token_logprobs(p, config, tokens, tokens, chunk_size=16, return_entropy=entropy)
        return sum(x.sum() for x in (out if entropy else (out,)))

    jaxpr = jax.make_jaxpr(jax.value_and_grad(loss))(params).jaxpr
    # [B, chunk, V] values are expected; nothing of the full [B, T, V] size.
    assert _largest_vocab_array(jaxpr, 1000) == 2 * 16 * 1000
    # The check itself sees a full-size value when there is one.
    full = jax.make_jaxpr(lambda p: forward(p, config, tokens).sum())(params).jaxpr
    assert _largest_vocab_array(full, 1000) == 2 * 64 * 1000


def test_bfloat16_model_runs_in_bfloat16_and_tracks_float32():
    config32, params32 = tiny_random_model("qwen3")
    config16, _ = tiny_random_model("qwen3", dtype="bfloat16")
    params16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params32)
    tokens, _, mask = _batch(config32.vocab_size)

    assert hidden_states(params16, config16, tokens, mask).dtype == jnp.bfloat16
    logits16 = forward(params16, config16, tokens, mask)
    assert logits16.dtype == jnp.float32
    real = np.asarray(mask, bool)
    logits32 = np.asarray(forward(params32, config32, tokens, mask))
    # bf16 keeps ~3 significant digits; the tiny model's logits are O(1).
    np.testing.assert_allclose(np.asarray(logits16)[real], logits32[real], atol=0.05)
