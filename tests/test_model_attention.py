"""The many-token attention behind one function: query chunks (the accelerator path) equal one
chunk (the CPU path) in values and gradients and never hold a [B, H, T, S] array; row lengths
(the training path) equal the attention mask of right-padded rows; packed rows equal their
sequences one per row; and, on an NVIDIA GPU only, cuDNN's fused kernel equals XLA's attention
forward and backward, on right-padded and on packed rows."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from devices import cuda_gpu, hopper
from helpers_hf import tiny_random_model
from rstar2_jax.model import forward, token_logprobs
from rstar2_jax.model import packed_attention, transformer

HIGHEST = jax.lax.Precision.HIGHEST


def _qkv(b, t, h, kv, d, dtype=jnp.float32, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (b, t, h, d), dtype)
    k = jax.random.normal(keys[1], (b, kv, t, d), dtype)
    v = jax.random.normal(keys[2], (b, kv, t, d), dtype)
    return q, k, v


def _packed_qkv(segment_lengths, t, h, kv, d, dtype=jnp.float32, seed=0):
    """`_qkv` over packed rows of t tokens, with the rows' `Segments` and the query side of
    their segment mask for `_attention` (each query's segment and index; the key side is
    segments.ids)."""
    segments = packed_attention.packed_segments(jnp.asarray(segment_lengths), t)
    b = segments.ids.shape[0]
    index = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    q_side = jnp.stack([segments.ids, index], axis=-1)
    return (*_qkv(b, t, h, kv, d, dtype, seed), segments, q_side)


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
            return _weighted_sum(transformer._attention(q, k, v, mask, None, chunk, HIGHEST), real)
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
        loss = lambda q, k, v: transformer._attention(q, k, v, mask, None, chunk, HIGHEST).sum()  # noqa: E731
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


# Two packed rows of 29 tokens: [11, 9, 0 (an unused slot), 5] + a 4-token tail, and [29].
PACKED = np.array([[11, 9, 0, 5], [29, 0, 0, 0]], np.int32)


def _pieces(segment_lengths, t):
    """(row, start, end) of every sequence of packed rows, the tail after the last one included."""
    out = []
    for row, lengths in enumerate(segment_lengths):
        ends = np.minimum(np.cumsum(lengths), t)
        starts = np.concatenate([[0], ends])
        out += [(row, s, e) for s, e in zip(starts, np.append(ends, t)) if e > s]
    return out


def test_packed_segments_positions_restart_at_zero():
    segments = packed_attention.packed_segments(jnp.asarray(PACKED), 29)
    np.testing.assert_array_equal(segments.ids[0], [0] * 11 + [1] * 9 + [3] * 5 + [4] * 4)
    np.testing.assert_array_equal(
        segments.positions[0], [*range(11), *range(9), *range(5), *range(4)])
    np.testing.assert_array_equal(segments.ids[1], [0] * 29)
    np.testing.assert_array_equal(segments.positions[1], range(29))
    # cuDNN's packed layout: empty segments last and -1, the tail reaching the even length.
    lengths, offsets = transformer._cudnn_segments(segments, 30)
    np.testing.assert_array_equal(lengths, [[11, 9, 5, 5, -1], [29, 1, -1, -1, -1]])
    np.testing.assert_array_equal(offsets, [[0, 11, 20, 25, -1, -1], [0, 29, -1, -1, -1, -1]])


@pytest.mark.parametrize("chunk", [29, 8])  # the CPU path (one chunk) and the accelerator one
def test_packed_rows_equal_their_sequences_one_per_row(chunk):
    """Attention over packed rows, values and gradients, equals each sequence's own causal
    attention."""
    t = 29
    q, k, v, segments, q_side = _packed_qkv(PACKED, t, 4, 2, 8)
    weights = jnp.sin(jnp.arange(q.size, dtype=jnp.float32).reshape(q.shape))

    def packed(q, k, v):
        return jnp.sum(transformer._attention(q, k, v, q_side, segments.ids, chunk, HIGHEST) * weights)

    def one_per_row(q, k, v):
        total = 0.0
        for row, start, end in _pieces(PACKED, t):
            out = transformer._attention(q[row:row + 1, start:end], k[row:row + 1, :, start:end],
                                         v[row:row + 1, :, start:end],
                                         _causal(end - start), None, end - start, HIGHEST)
            total += jnp.sum(out * weights[row:row + 1, start:end])
        return total

    value, grads = jax.value_and_grad(packed, argnums=(0, 1, 2))(q, k, v)
    ref_value, ref_grads = jax.value_and_grad(one_per_row, argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(value, ref_value, atol=1e-5)  # a sum of ~3,000 terms
    for name, g, r in zip("qkv", grads, ref_grads):
        np.testing.assert_allclose(g, r, atol=1e-6, err_msg=name)


def test_packed_query_chunks_hold_neither_all_scores_nor_a_full_mask():
    b, t, h, chunk = 2, 64, 2, 16
    q, k, v, segments, q_side = _packed_qkv([[20, 30], [64, 0]], t, h, 1, 2)
    loss = lambda q, k, v: transformer._attention(q, k, v, q_side, segments.ids, chunk, HIGHEST).sum()  # noqa: E731
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr
    assert _largest_array(jaxpr) == b * h * chunk * t < b * t * t  # one chunk's scores


def _causal(t):
    return jnp.tril(jnp.ones((t, t), bool))[None]


def _largest_array(jaxpr) -> int:
    """Elements of the largest value of any dtype that any equation (nested ones too) produces."""
    largest = 0
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            if hasattr(var.aval, "shape"):
                largest = max(largest, int(np.prod(var.aval.shape)))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    largest = max(largest, _largest_array(sub))
    return largest


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_packed_token_logprobs_equal_one_sequence_per_row(model_type):
    """The model over packed rows (positions restarting at 0, attention within each sequence)
    gives each sequence's log-probs and their gradients as one right-padded row per sequence."""
    config, params = tiny_random_model(model_type)
    rng = np.random.default_rng(7)
    b, t = PACKED.shape[0], 29
    tokens = rng.integers(0, config.vocab_size, (b, t)).astype(np.int32)
    targets = rng.integers(0, config.vocab_size, (b, t)).astype(np.int32)
    pieces = [p for p in _pieces(PACKED, t) if not (p[0] == 0 and p[1] == 25)]  # not the tail
    weights = rng.normal(size=(b, t)).astype(np.float32)
    counted = np.zeros((b, t), bool)
    for row, start, end in pieces:
        counted[row, start:end] = True

    def packed(p):
        logp = token_logprobs(p, config, tokens, targets, segment_lengths=jnp.asarray(PACKED),
                              chunk_size=8)
        return jnp.sum(jnp.where(counted, logp * weights, 0.0)), logp

    longest = max(end - start for _, start, end in pieces)
    rows = np.zeros((len(pieces), longest), np.int32)
    row_targets, row_weights = np.zeros_like(rows), np.zeros(rows.shape, np.float32)
    lengths = np.array([end - start for _, start, end in pieces], np.int32)
    for i, (row, start, end) in enumerate(pieces):
        rows[i, :end - start] = tokens[row, start:end]
        row_targets[i, :end - start] = targets[row, start:end]
        row_weights[i, :end - start] = weights[row, start:end]

    def one_per_row(p):
        logp = token_logprobs(p, config, rows, row_targets, lengths=jnp.asarray(lengths),
                              chunk_size=8)
        real = np.arange(longest)[None] < lengths[:, None]
        return jnp.sum(jnp.where(real, logp * row_weights, 0.0)), logp

    (value, logp), grads = jax.value_and_grad(packed, has_aux=True)(params)
    (ref_value, ref_logp), ref_grads = jax.value_and_grad(one_per_row, has_aux=True)(params)
    assert np.isfinite(logp).all()
    for i, (row, start, end) in enumerate(pieces):
        np.testing.assert_allclose(logp[row, start:end], ref_logp[i, :end - start], atol=1e-5)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(ref_grads),
                            strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))


@pytest.mark.skipif(not cuda_gpu(), reason="cuDNN's fused attention needs an NVIDIA GPU")
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


@pytest.mark.skipif(not cuda_gpu(), reason="cuDNN's fused attention needs an NVIDIA GPU")
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


@pytest.mark.skipif(not hopper(), reason="cuDNN's packed layout needs an NVIDIA GPU, Hopper or later")
def test_cudnn_packed_rows_match_the_segment_mask_path():
    """Packed rows in bfloat16 at the training layout (GQA 16/8, head_dim 128, an odd length as
    a train step's seq - 1 has): `attention` runs cuDNN's packed kernel with no boolean mask,
    and its output and gradients equal the query-chunked path's under the segment mask."""
    b, t, h, kv, d = 2, 511, 16, 8, 128
    q, k, v, segments, q_side = _packed_qkv([[200, 0, 150, 100], [511, 0, 0, 0]], t, h, kv, d,
                                            jnp.bfloat16)
    real = jnp.ones((b, t), bool)

    def ours(q, k, v):
        return transformer.attention(q, k, v, segments=segments)

    def chunked(q, k, v):
        return transformer._attention(q, k, v, q_side, segments.ids, 128, None)

    grad_fn = jax.jit(jax.grad(lambda *a: _weighted_sum(ours(*a), real), argnums=(0, 1, 2)))
    hlo = grad_fn.lower(q, k, v).compile().as_text().lower()
    assert "cudnn" in hlo
    assert f"pred[{b},{t}" not in hlo and f"pred[{b},{t + 1}" not in hlo  # no boolean [T, T] mask

    def run(fn):
        return jax.jit(jax.value_and_grad(lambda *a: _weighted_sum(fn(*a), real),
                                          argnums=(0, 1, 2)))(q, k, v)

    (_, grads), (_, ref_grads) = run(ours), run(chunked)
    out, ref_out = np.asarray(ours(q, k, v), np.float32), np.asarray(chunked(q, k, v), np.float32)
    np.testing.assert_allclose(out, ref_out, atol=2e-2)
    for name, g, r in zip("qkv", grads, ref_grads):
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        assert np.abs(g - r).max() <= 5e-2 * np.abs(r).max(), name
        assert np.sum(g * r) / (np.linalg.norm(g) * np.linalg.norm(r)) > 0.999, name


# Packed layouts for the block-skipping kernel (blocks of 8 tokens): one segment over many
# blocks and a tail; many tiny segments; empty slots and a padding tail (t no multiple of 8);
# a row that is all tail.
BLOCK_LAYOUTS = [
    (np.array([[45, 0, 0], [3, 40, 0]], np.int32), 50),
    (np.array([[1, 2, 1, 3, 1, 1, 2, 5, 1, 1, 4, 2], [7, 1, 1, 9, 1, 2, 3, 1, 1, 1, 1, 1]],
               np.int32), 40),
    (np.array([[11, 9, 0, 5], [0, 0, 17, 0], [0, 0, 0, 0]], np.int32), 29),
]


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("layout", range(len(BLOCK_LAYOUTS)))
def test_block_skipping_equals_the_segment_mask_in_values_and_gradients(layout, group):
    """`_packed_attention` (only the key blocks each query block needs) equals scoring whole
    rows under the segment mask, values and gradients of q, k and v, grouped-query heads."""
    segment_lengths, t = BLOCK_LAYOUTS[layout]
    q, k, v, segments, q_side = _packed_qkv(segment_lengths, t, 4, 2, 8, seed=layout)
    weights = jnp.sin(jnp.arange(q.size, dtype=jnp.float32).reshape(q.shape))

    def masked(q, k, v):
        return jnp.sum(transformer._attention(q, k, v, q_side, segments.ids, t, HIGHEST) * weights)

    def skipping(q, k, v):
        out = packed_attention._packed_attention(q, k, v, segments.ids, segments.bounds, 8,
                                                 group, HIGHEST)
        return jnp.sum(out * weights)

    value, grads = jax.value_and_grad(skipping, argnums=(0, 1, 2))(q, k, v)
    ref_value, ref_grads = jax.value_and_grad(masked, argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(value, ref_value, atol=1e-5)
    for name, g, r in zip("qkv", grads, ref_grads):
        np.testing.assert_allclose(g, r, atol=1e-6, err_msg=name)


def test_block_plan_visits_only_blocks_sharing_a_segment_up_to_the_diagonal():
    # Row 0: segments [0, 12), [12, 13), [13, 30) and the tail [30, 32) over blocks of 8.
    # Row 1: one segment [0, 32).
    segments = packed_attention.packed_segments(jnp.array([[12, 1, 17], [32, 0, 0]], jnp.int32), 32)
    per_query, per_key = packed_attention.packed_block_plan(segments, 32, 8)
    # Block 2 starts in [13, 30) (first key block 1), block 3 in [13, 30) too.
    np.testing.assert_array_equal(per_query, [[1, 2, 2, 3], [1, 2, 3, 4]])
    # Key block 0 is needed by query blocks 0 and 1, key block 1 by 1, 2 and 3.
    np.testing.assert_array_equal(per_key, [[2, 3, 2, 1], [4, 3, 2, 1]])
    # Groups of 3 items, longest first (4, 3, 3 | 2, 2, 2 | 1, 1 and a dummy), loop as long
    # as their first.
    lengths = np.array([[12, 1, 17], [32, 0, 0]], np.int32)
    visits = packed_attention.packed_block_visits
    assert visits(lengths, 32, 8, 3) == (3 * (4 + 2 + 1), 3 * (4 + 2 + 1))
    assert visits(lengths, 32, 8, 1) == (18, 18)


def test_block_skipping_program_does_not_grow_with_the_row_length():
    """Lax loops, not unrolled blocks: the backward pass's program is the same size at 64 and
    at 512 tokens, and holds one group's scores at most, never a [B, H, T, S] array."""
    def grad_jaxpr(t):
        q, k, v, segments, _ = _packed_qkv([[t // 2, t // 4]] * 2, t, 4, 2, 8)

        def loss(q, k, v):
            return packed_attention._packed_attention(q, k, v, segments.ids, segments.bounds,
                                                      16, 2, HIGHEST).sum()
        return jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr

    def size(jaxpr):
        total = len(jaxpr.eqns)
        for eqn in jaxpr.eqns:
            for param in eqn.params.values():
                for sub in param if isinstance(param, (list, tuple)) else [param]:
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        total += size(sub)
        return total

    short, long = grad_jaxpr(64), grad_jaxpr(512)
    assert size(short) == size(long)
    assert _largest_float_array(long) < 2 * 4 * 512 * 512


def test_attention_skips_blocks_of_long_packed_rows():
    """`attention` over packed rows longer than `_WHOLE_ROW` runs the block-skipping kernel (on
    every backend) and equals scoring whole rows under the segment mask."""
    t = transformer._WHOLE_ROW + 9
    q, k, v, segments, q_side = _packed_qkv([[300, 7, 150], [t, 0, 0]], t, 2, 1, 4)
    out = transformer.attention(q, k, v, segments=segments, precision=HIGHEST)
    ref = transformer._attention(q, k, v, q_side, segments.ids, t, HIGHEST)
    np.testing.assert_allclose(out, ref, atol=1e-6)
    jaxpr = jax.make_jaxpr(lambda q: transformer.attention(q, k, v, segments=segments))(q).jaxpr
    assert _largest_float_array(jaxpr) < 2 * 2 * t * t  # no whole row's scores


@pytest.mark.parametrize("cudnn", ["right", "raises", "ignores_segments"])
def test_packed_rows_take_cudnn_only_where_it_agrees_with_the_block_kernel(cudnn, monkeypatch, caplog):
    """cuDNN's packed attention is checked against the block kernel on its first use (here a
    stand-in on CPU, traced under jit): one that fails or attends across segments is never
    used, and a warning says so."""
    def block_kernel(q, k, v, lengths, segments):
        return packed_attention._packed_attention(q, k, v, segments.ids, segments.bounds,
                                                  packed_attention._BLOCK, 1, None)

    def stand_in(q, k, v, lengths, segments):
        calls.append(segments is not None)
        if cudnn == "raises":
            raise RuntimeError("no such cuDNN kernel")
        if cudnn == "ignores_segments":
            return transformer._attention(q, k, v, transformer._causal_mask(
                q.shape[0], q.shape[1], None), None, q.shape[1], None)
        return block_kernel(q, k, v, lengths, segments)

    calls = []
    transformer._cudnn_packed_agrees.cache_clear()
    monkeypatch.setattr(transformer, "_cudnn_supports", lambda q, packed=False: True)
    monkeypatch.setattr(transformer, "_cudnn_causal", stand_in)
    rng = np.random.default_rng(3)
    t = 600  # past _WHOLE_ROW: without cuDNN, CPU packed rows take the block kernel
    q = jnp.asarray(rng.standard_normal((1, t, 4, 16)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((1, 2, t, 16)), jnp.bfloat16) for _ in range(2))
    segments = packed_attention.packed_segments(jnp.array([[250, 300, 0, 0]], jnp.int32), t)
    try:
        with caplog.at_level("WARNING", logger="rstar2_jax.model.transformer"):
            out = jax.jit(lambda q, k, v: transformer.attention(q, k, v, segments=segments))(q, k, v)
    finally:
        transformer._cudnn_packed_agrees.cache_clear()
    want = block_kernel(q, k, v, None, segments)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                               atol=2e-2, rtol=0)
    if cudnn == "right":
        assert len(calls) == 2 and not caplog.records  # traced by the check, then used
    else:
        assert len(calls) == 1  # tried by the check only
        assert "packed rows use the block kernel" in caplog.text
