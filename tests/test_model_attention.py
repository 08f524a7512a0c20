"""The many-token attention behind one function: query chunks (the accelerator path) equal one
chunk (the CPU path) in values and gradients and never hold a [B, H, T, S] array; row lengths
(the training path) equal the attention mask of right-padded rows; and, on an NVIDIA GPU only,
cuDNN's fused kernel equals XLA's attention forward and backward."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers_hf import tiny_random_model
from rstar2_jax.model import forward, token_logprobs
from rstar2_jax.model import transformer

HIGHEST = jax.lax.Precision.HIGHEST


def _qkv(b, t, h, kv, d, dtype=jnp.float32, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (b, t, h, d), dtype)
    k = jax.random.normal(keys[1], (b, kv, t, d), dtype)
    v = jax.random.normal(keys[2], (b, kv, t, d), dtype)
    return q, k, v


def _weighted_sum(out, real):
    """A loss that weighs every real output element differently (pads get no gradient)."""
    w = jnp.sin(jnp.arange(out.size, dtype=jnp.float32).reshape(out.shape))
    return jnp.sum(out.astype(jnp.float32) * w * real[:, :, None, None])


def test_query_chunks_match_one_chunk_in_values_and_gradients():
    b, t = 2, 37  # 37 is no multiple of the chunk: the last chunk is padded
    q, k, v = _qkv(b, t, 4, 2, 8)
    # Row 0 right-padded, row 1 left-padded: any mask pattern goes through the chunks.
    real = np.ones((b, t), bool)
    real[0, 30:] = False
    real[1, :5] = False
    mask = jnp.asarray(np.tril(np.ones((t, t), bool))[None] & real[:, None, :])
    real = jnp.asarray(real)

    def run(chunk):
        def loss(q, k, v):
            return _weighted_sum(transformer._attention(q, k, v, mask, chunk, HIGHEST), real)
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

    (value, grads), (chunked_value, chunked_grads) = run(t), run(8)
    np.testing.assert_allclose(chunked_value, value, rtol=1e-5)
    for name, g, c in zip("qkv", grads, chunked_grads):
        assert np.isfinite(c).all(), name
        np.testing.assert_allclose(c, g, atol=1e-5, err_msg=name)


def _largest_float_array(jaxpr) -> int:
    """Elements of the largest floating-point value any equation (nested ones too) produces."""
    largest = 0
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            aval = var.aval
            if hasattr(aval, "shape") and jnp.issubdtype(aval.dtype, jnp.floating):
                largest = max(largest, int(np.prod(aval.shape)))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
                if hasattr(sub, "eqns"):
                    largest = max(largest, _largest_float_array(sub))
    return largest


def test_query_chunks_never_hold_all_scores():
    b, t, h = 2, 64, 4
    q, k, v = _qkv(b, t, h, 2, 8)
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))

    def grad_jaxpr(chunk):
        loss = lambda q, k, v: transformer._attention(q, k, v, mask, chunk, HIGHEST).sum()  # noqa: E731
        return jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr

    all_scores = b * h * t * t
    assert _largest_float_array(grad_jaxpr(16)) == all_scores // 4  # one chunk's scores
    assert _largest_float_array(grad_jaxpr(t)) == all_scores  # the check sees them when present


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_row_lengths_equal_the_attention_mask_of_right_padded_rows(model_type):
    config, params = tiny_random_model(model_type)
    rng = np.random.default_rng(3)
    lengths = np.array([37, 12, 1], np.int32)
    tokens = rng.integers(0, config.vocab_size, (3, 37)).astype(np.int32)
    mask = (np.arange(37)[None] < lengths[:, None]).astype(np.int32)
    real = mask.astype(bool)

    by_mask = np.asarray(forward(params, config, tokens, mask))
    by_lengths = np.asarray(forward(params, config, tokens, lengths=jnp.asarray(lengths)))
    np.testing.assert_allclose(by_lengths[real], by_mask[real], atol=1e-5)
    assert np.isfinite(by_lengths).all()

    def loss(p, **padding):
        logp = token_logprobs(p, config, tokens, np.roll(tokens, -1, 1), chunk_size=16, **padding)
        return jnp.sum(jnp.where(real, logp, 0.0))

    g_mask = jax.grad(loss)(params, attention_mask=mask)
    g_lengths = jax.grad(loss)(params, lengths=jnp.asarray(lengths))
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(g_lengths)[0],
                            jax.tree.leaves(g_mask), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))
    with pytest.raises(ValueError, match="not both"):
        forward(params, config, tokens, mask, lengths=jnp.asarray(lengths))


def _cuda_gpu() -> bool:
    return (jax.default_backend() == "gpu"
            and "cuda" in jax.extend.backend.get_backend().platform_version.lower())


@pytest.mark.skipif(not _cuda_gpu(), reason="cuDNN's fused attention needs an NVIDIA GPU")
def test_cudnn_attention_matches_xla_forward_and_gradients():
    """The training shape's layout (GQA 16/8, head_dim 128, causal, right-padded rows) in
    bfloat16: `attention` runs cuDNN's kernel, and its output and gradients equal XLA's."""
    b, t, h, kv, d = 4, 512, 16, 8, 128
    q, k, v = _qkv(b, t, h, kv, d, jnp.bfloat16)
    lengths = jnp.array([512, 300, 129, 1], jnp.int32)
    real = jnp.arange(t)[None] < lengths[:, None]

    def ours(q, k, v):
        return transformer.attention(q, k, v, lengths=lengths)

    def xla(q, k, v):
        return jax.nn.dot_product_attention(
            q, k.swapaxes(1, 2), v.swapaxes(1, 2), is_causal=True, query_seq_lengths=lengths,
            key_value_seq_lengths=lengths, implementation="xla")

    hlo = jax.jit(jax.grad(lambda *a: _weighted_sum(ours(*a), real), argnums=(0, 1, 2))).lower(
        q, k, v).compile().as_text()
    assert "cudnn" in hlo.lower()  # the fused kernel ran, forward and backward

    def run(fn):
        return jax.jit(jax.value_and_grad(lambda *a: _weighted_sum(fn(*a), real),
                                          argnums=(0, 1, 2)))(q, k, v)

    (_, grads), (_, ref_grads) = run(ours), run(xla)
    out, ref_out = np.asarray(ours(q, k, v), np.float32), np.asarray(xla(q, k, v), np.float32)
    np.testing.assert_allclose(out[np.asarray(real)], ref_out[np.asarray(real)], atol=2e-2)
    for name, g, r in zip("qkv", grads, ref_grads):
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        assert np.abs(g - r).max() <= 5e-2 * np.abs(r).max(), name
        assert np.sum(g * r) / (np.linalg.norm(g) * np.linalg.norm(r)) > 0.999, name


@pytest.mark.skipif(not _cuda_gpu(), reason="cuDNN's fused attention needs an NVIDIA GPU")
def test_a_bfloat16_training_pass_through_cudnn_matches_the_masked_path():
    """The training path end to end in bfloat16 (row lengths, an odd length as a train step's
    seq - 1 has, the layer's rematerialisation): log-probs and gradients through cuDNN equal
    those of the attention-mask path, which runs XLA's query-chunked attention."""
    config, params = tiny_random_model("qwen3")  # float32 params (master weights)
    config = dataclasses.replace(config, dtype="bfloat16")
    rng = np.random.default_rng(5)
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (3, 37)), jnp.int32)
    lengths = jnp.array([37, 20, 5], jnp.int32)
    real = np.arange(37)[None] < np.asarray(lengths)[:, None]

    def loss(p, **padding):
        logp = token_logprobs(p, config, tokens, jnp.roll(tokens, -1, 1), chunk_size=16, **padding)
        return jnp.sum(jnp.where(real, logp, 0.0))

    by_lengths = jax.jit(jax.value_and_grad(lambda p: loss(p, lengths=lengths)))
    assert "cudnn" in by_lengths.lower(params).compile().as_text().lower()
    value, grads = by_lengths(params)
    ref_value, ref_grads = jax.jit(jax.value_and_grad(
        lambda p: loss(p, attention_mask=jnp.asarray(real, jnp.int32))))(params)
    np.testing.assert_allclose(value, ref_value, rtol=1e-2)
    for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(ref_grads),
                            strict=True):
        assert g.dtype == r.dtype == jnp.float32
        cosine = jnp.sum(g * r) / (jnp.linalg.norm(g) * jnp.linalg.norm(r))
        assert cosine > 0.999, (jax.tree_util.keystr(path), float(cosine))
