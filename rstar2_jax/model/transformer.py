"""The Qwen2 / Qwen3 decoder as pure functions of the params pytree (see `params.py`).

Shapes: B batch, T query tokens, S key slots, E hidden, H query heads, K kv heads, D head dim,
V vocab. Activations between layers are in `config.dtype` (the compute dtype; weights stored in
another dtype are cast to it where they are used); RMSNorm, RoPE angles, attention
scores/softmax and logits are float32. Every matmul states its precision (`config.precision`).

Padding: `forward` takes `attention_mask [B, T]` (1 = real token) and gives each real token the
position `cumsum(mask) - 1`, so left- and right-padded batches both give the same logits at real
positions as the unpadded rows would; or `lengths [B]` for right-padded rows, which lets
attention run as a fused causal kernel; or `segment_lengths [B, M]` for packed rows, several
sequences per row, each attending only to itself with positions from 0 (`Segments`, in
`packed_attention.py` with the block kernel that attends over them). Logits at pad positions
are garbage (finite, never NaN).
"""
from __future__ import annotations

import functools
import logging
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.cudnn import fused_attention_stablehlo as _cudnn_attention

from rstar2_jax.model import target
from rstar2_jax.model.config import ModelConfig
from rstar2_jax.model.packed_attention import (
    _BLOCK,
    _GROUP,
    _MASKED,
    KEPT_NAME,
    Segments,
    _grouped,
    _packed_attention,
    _ungrouped,
    packed_segments,
)
from rstar2_jax.model.tpu_attention import splash_packed_attention

log = logging.getLogger(__name__)

# Called by a layer with its queries [B, T, H, D] and new keys/values [B, K, T, D]; returns the
# attention output [B, T, H, D] (a KV cache stores the new keys/values and attends over all the
# keys it holds).
Attend = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, normalised in float32; returns x's dtype. x [..., N], scale [N]."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    # Like transformers: cast back before the scale, so bf16 models round at the same place.
    return scale.astype(x.dtype) * normed.astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding, rotating the two halves of the head dim. x [B, T, N, D], positions [B, T]."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)  # [D/2]
    angles = positions.astype(jnp.float32)[:, :, None, None] * inv_freq  # [B, T, 1, D/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None = None, *,
              lengths: jax.Array | None = None, segments: Segments | None = None,
              precision: jax.lax.Precision | None = None) -> jax.Array:
    """Grouped-query attention. q [B, T, H, D], k/v [B, K, S, D] -> [B, T, H, D] in q's dtype.

    `mask` [B, T, S] bool says which keys each query sees (any pattern: a cache's slots, left
    padding). Without it the attention is causal self-attention (S = T): over packed rows if
    `segments` is given (each segment attends only to itself), else over right-padded rows
    whose first `lengths[b]` tokens are real (default all T); a pad query's output is garbage.
    `precision` is that of the matmuls (see `ModelConfig.precision`).

    Which kernel runs (the same result up to rounding; docs/accelerators.md), for the device
    the program is compiled for (`target.current`), not the process's default backend:
      - causal, bfloat16 or float16, on an NVIDIA GPU: cuDNN's fused flash attention, masking
        by its causal mask and the sequence lengths, or, for packed rows on Hopper or later,
        the segments' offsets and lengths (scoring each segment only against itself); no
        boolean mask, which would slow its backward pass;
      - packed rows in bfloat16 on a TPU: splash attention (`tpu_attention`), causal with the
        segments' ids, forward and backward;
      - a decode step (T = 1) with a mask: `_decode_attention`;
      - other packed rows, on accelerators and on CPU rows longer than `_WHOLE_ROW` tokens:
        `_packed_attention` (packed_attention.py), which computes only the key blocks of
        `_BLOCK` tokens each query block needs (its own segments', up to the causal diagonal),
        with a hand-written backward pass, `_GROUP` (row, block) items at a time on
        accelerators (not yet measured there), one on CPU (the fastest there with mixed
        lengths). On CPU at 2 x 4,096 tokens it is 2-3x faster than scoring whole rows with one
        sequence per row, ~9x with 1,000-token sequences;
      - otherwise `_attention`, with a hand-written backward pass; on CPU it scores all queries
        at once (the fastest there), on accelerators a chunk of `_QUERY_CHUNK` queries at a
        time, so that no [B, H, T, S] array of scores exists. Packed rows of at most
        `_WHOLE_ROW` tokens on CPU are scored whole under a segment mask: the block kernel is
        faster there too (2-4x at the demo's 16 x 256 tokens, ~0.02 s a layer), but whole rows
        round as right-padded rows do, which packed batches are pinned to (an update's
        parameters within 1e-6 of the padded batch's).
    """
    where = target.current()
    cpu = where.platform == "cpu"
    if mask is None:
        if _cudnn_supports(q, packed=segments is not None) and (
                segments is None or where.compile_only
                or _cudnn_packed_agrees(q.dtype, q.shape[2], k.shape[1], q.shape[3])):
            return _cudnn_causal(q, k, v, lengths, segments)
        if segments is not None and where.platform == "tpu" and q.dtype == jnp.bfloat16:
            return splash_packed_attention(q, k, v, segments)
        if segments is not None and not (cpu and q.shape[1] <= _WHOLE_ROW):
            return _packed_attention(q, k, v, segments.ids, segments.bounds, _BLOCK,
                                     1 if cpu else _GROUP, precision)
        if segments is None:
            mask = _causal_mask(q.shape[0], q.shape[1], lengths)
    chunk = q.shape[1] if cpu else _QUERY_CHUNK
    if mask is None:
        # The query side carries each query's segment and index, the key side each key's
        # segment: `_visible` builds one chunk's mask from them.
        index = jnp.broadcast_to(jnp.arange(q.shape[1], dtype=jnp.int32), segments.ids.shape)
        return _attention(q, k, v, jnp.stack([segments.ids, index], axis=-1), segments.ids,
                          chunk, precision)
    if q.shape[1] == 1:
        return _decode_attention(q, k, v, mask, precision)
    return _attention(q, k, v, mask, None, chunk, precision)


# Queries scored at once by `_attention` on accelerators: the scores of one chunk are
# [B, H, 512, S] float32 (0.5 GB at 8 x 16 heads x 2,048 keys).
_QUERY_CHUNK = 512

# Packed rows of at most `_WHOLE_ROW` tokens are scored whole on CPU rather than by the block
# kernel (`attention` says why).
_WHOLE_ROW = 512


def _causal_mask(batch: int, t: int, lengths: jax.Array | None) -> jax.Array:
    """[B, T, T] bool: query t sees keys s <= t that are among its row's first lengths[b]."""
    mask = jnp.tril(jnp.ones((t, t), bool))[None]
    if lengths is None:
        return jnp.broadcast_to(mask, (batch, t, t))
    return mask & (jnp.arange(t) < lengths[:, None, None])


def _cudnn_supports(q: jax.Array, packed: bool = False) -> bool:
    """Whether cuDNN's flash attention runs on the target (`target.current`): an NVIDIA GPU (not
    ROCm), a 16-bit dtype and a head dim it takes (a multiple of 8, at most 128 on every GPU
    generation); packed rows (segment offsets) need compute capability 9.0 (Hopper) or later."""
    d = q.shape[-1]
    if q.dtype not in (jnp.bfloat16, jnp.float16) or d % 8 or d > 128:
        return False
    where = target.current()
    if where.platform != "cuda":
        return False
    return not packed or (where.compute_capability or 0.0) >= 9.0


@functools.cache
def _cudnn_packed_agrees(dtype, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether cuDNN's attention over packed rows gives the block kernel's values and
    gradients, on this device, for a small packed batch of this layout. Checked once per
    layout, at the first trace that would use it, because it reaches cuDNN through a private
    JAX function: if it fails or disagrees, a warning says so and packed rows take the block
    kernel, never a wrong result."""
    rng = np.random.default_rng(0)
    t = 2 * _BLOCK
    q, k, v, weight = (rng.standard_normal(shape).astype(np.float32) for shape in (
        (2, t, heads, head_dim), (2, kv_heads, t, head_dim), (2, kv_heads, t, head_dim),
        (2, t, heads, head_dim)))

    def probe(attend):
        def loss(q, k, v):
            out = attend(q.astype(dtype), k.astype(dtype), v.astype(dtype))
            return jnp.sum(out.astype(jnp.float32) * weight), out
        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return [np.asarray(x, np.float32) for x in (out, *grads)]

    # Evaluated now, also when `attention` is being traced under jit.
    with jax.ensure_compile_time_eval():
        segments = packed_segments(jnp.array([[100, 60, 1, 0], [t - 31, 0, 0, 0]], jnp.int32), t)
        want = probe(lambda q, k, v: _packed_attention(q, k, v, segments.ids, segments.bounds,
                                                       _BLOCK, _GROUP, None))
        try:
            got = probe(lambda q, k, v: _cudnn_causal(q, k, v, None, segments))
        except Exception as e:  # noqa: BLE001 -- any failure means: do not use it
            log.warning("cuDNN attention over packed rows failed (%s: %s); packed rows use the "
                         "block kernel", type(e).__name__, e)
            return False
    # A 16-bit dtype's rounding is ~1e-2 of unit-sized values; attention across segments or
    # past the diagonal is off by the size of the values themselves.
    worst = max(float(np.max(np.abs(g - w)) / (np.max(np.abs(w)) + 1e-6)) for g, w in zip(got, want))
    if worst > 0.05:
        log.warning("cuDNN attention over packed rows disagrees with the block kernel (%.3g of "
                     "the largest value, output or gradient); packed rows use the block kernel",
                     worst)
        return False
    return True


def _cudnn_causal(q, k, v, lengths, segments=None):
    """Causal attention by cuDNN; k/v [B, K, S, D] as `attention` takes them (the transposes to
    its [B, S, K, D] cancel against the model's own). The sequence is padded to an even length,
    which JAX's cuDNN training kernels require (a training step's inputs are seq - 1 long);
    causality keeps the real queries off the padded keys (in packed rows, the tail segment
    takes the padded token in)."""
    t = q.shape[1]
    if t % 2:
        q = jnp.pad(q, [(0, 0), (0, 1), (0, 0), (0, 0)])
        k, v = (jnp.pad(x, [(0, 0), (0, 0), (0, 1), (0, 0)]) for x in (k, v))
    k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    if segments is not None:
        seq_lengths, offsets = _cudnn_segments(segments, q.shape[1])
        # `jax.nn.dot_product_attention` (JAX 0.10.2) takes no segment offsets; the function
        # it calls for cuDNN does (its packed layout, Hopper or later).
        out = _cudnn_attention.dot_product_attention(
            q, k, v, q_seqlen=seq_lengths, kv_seqlen=seq_lengths, q_offsets=offsets,
            kv_offsets=offsets, scale=q.shape[-1]**-0.5,
            mask_type=_cudnn_attention.MaskType.PADDING_CAUSAL, qkv_layout="BTNH")
        return out[:, :t]
    if lengths is not None:
        lengths = jnp.maximum(lengths, 1).astype(jnp.int32)  # an empty row would give NaNs
    out = jax.nn.dot_product_attention(
        q, k, v, is_causal=True, query_seq_lengths=lengths, key_value_seq_lengths=lengths,
        implementation="cudnn")
    return out[:, :t]


def _cudnn_segments(segments: Segments, t: int) -> tuple[jax.Array, jax.Array]:
    """cuDNN's packed layout of `segments` over rows of t tokens (the tail segment reaching
    t): the segments' lengths int32 [B, M + 1] and first tokens [B, M + 2], the empty ones
    moved to the end and given as -1 (as cuDNN takes them; the last offset is always -1)."""
    bounds = segments.bounds.at[:, -1].set(t)
    lengths, starts = bounds[:, 1:] - bounds[:, :-1], bounds[:, :-1]
    order = jnp.argsort(lengths == 0, axis=1, stable=True)
    lengths, starts = (jnp.take_along_axis(x, order, axis=1) for x in (lengths, starts))
    starts = jnp.where(lengths > 0, starts, -1)
    starts = jnp.concatenate([starts, jnp.full((starts.shape[0], 1), -1, jnp.int32)], axis=1)
    return jnp.where(lengths > 0, lengths, -1), starts


def _decode_attention(q, k, v, mask, precision=None):
    """`attention` of one query token per row. XLA:CPU runs it ~2x faster with the key slots
    ahead of the query heads in the scores ([B, K, S, G]) than in the many-token order."""
    b, _, h, d = q.shape
    kv_heads = k.shape[1]
    q = q.reshape(b, kv_heads, h // kv_heads, d)  # [B, K, G, D]: query head h reads kv head h // G
    scores = jnp.einsum("bkgd,bksd->bksg", q, k, precision=precision,
                        preferred_element_type=jnp.float32) * d**-0.5
    scores = jnp.where(mask[:, 0, None, :, None], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=2).astype(v.dtype)
    return jnp.einsum("bksg,bksd->bkgd", probs, v, precision=precision).reshape(b, 1, h, d)


def _visible(q_side, k_side):
    """[B, C, S] bool: which keys each of a chunk's C queries sees. q_side is the chunk's rows
    of `_attention`'s mask [B, C, S] (k_side None), or of its queries' (segment, index) int32
    [B, C, 2] with k_side the keys' segments [B, S]: a query sees the keys of its own segment
    up to itself."""
    if k_side is None:
        return q_side
    keys = jnp.arange(k_side.shape[1], dtype=jnp.int32)
    return ((q_side[:, :, None, 0] == k_side[:, None, :])
            & (q_side[:, :, None, 1] >= keys[None, None, :]))


def _masked_scores(q, k, mask, precision):
    """float32 scaled scores [B, K, G, T, S] of grouped q and k, _MASKED where mask is False."""
    scores = jnp.einsum("bkgtd,bksd->bkgts", q, k, precision=precision,
                        preferred_element_type=jnp.float32)
    return jnp.where(mask[:, None, None], scores * q.shape[-1]**-0.5, _MASKED)


def _block_fwd(qg, k, v, mask, precision):
    """Attention of grouped queries qg [B, K, G, C, D] to all keys: float32 output [B, K, G, C, D]
    and the softmax's row max and sum [B, K, G, C, 1] (as in jax.nn.softmax)."""
    scores = _masked_scores(qg, k, mask, precision)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    unnormalized = jnp.exp(scores - row_max)
    row_sum = jnp.sum(unnormalized, axis=-1, keepdims=True)
    probs = (unnormalized / row_sum).astype(v.dtype)
    out = jnp.einsum("bkgts,bksd->bkgtd", probs, v, precision=precision,
                     preferred_element_type=jnp.float32)
    return out, row_max, row_sum


def _block_bwd(qg, k, v, mask, out, row_max, row_sum, d_out_g, precision):
    """Gradients of `_block_fwd`'s output (float32 d_q [B, K, G, C, D], d_k, d_v [B, K, S, D])
    from the kept row max and sum: the probabilities are recomputed, never stored."""
    probs = jnp.exp(_masked_scores(qg, k, mask, precision) - row_max) / row_sum  # [B, K, G, C, S]
    d_v = jnp.einsum("bkgts,bkgtd->bksd", probs.astype(v.dtype), d_out_g, precision=precision,
                     preferred_element_type=jnp.float32)
    d_probs = jnp.einsum("bkgtd,bksd->bkgts", d_out_g, v, precision=precision,
                         preferred_element_type=jnp.float32)
    # Softmax backward, with sum_s probs * d_probs = sum_d out * d_out (no pass over [C, S]).
    # Masked scores get no gradient: a fully masked row's uniform probabilities must not leak.
    row_dot = jnp.sum(out * d_out_g.astype(jnp.float32), axis=-1, keepdims=True)
    d_scores = jnp.where(mask[:, None, None], probs * (d_probs - row_dot), 0.0)
    d_scores = (d_scores * qg.shape[-1]**-0.5).astype(qg.dtype)
    d_q = jnp.einsum("bkgts,bksd->bkgtd", d_scores, k, precision=precision,
                     preferred_element_type=jnp.float32)
    d_k = jnp.einsum("bkgts,bkgtd->bksd", d_scores, qg, precision=precision,
                     preferred_element_type=jnp.float32)
    return d_q, d_k, d_v


def _query_chunks(x, axis, chunk):
    """x with its query axis (size T) split into [n, ..., chunk, ...] (n = ceil(T / chunk)),
    zero/False-padded at the end: a padded query gets no gradient."""
    pad = -x.shape[axis] % chunk
    x = jnp.pad(x, [(0, pad) if a == axis else (0, 0) for a in range(x.ndim)])
    x = x.reshape(*x.shape[:axis], -1, chunk, *x.shape[axis + 1:])
    return jnp.moveaxis(x, axis, 0)


def _attention_fwd(q, k, v, q_side, k_side, chunk, precision):
    """Output [B, T, H, D], and the residuals: q, k, v, the mask's two sides and the float32
    output, row max and row sum of `_block_fwd`, [B, K, G, T, ...] for one chunk,
    [n, B, K, G, chunk, ...] for n."""
    qg = _grouped(q, k.shape[1])
    t = q.shape[1]
    if t <= chunk:
        out, row_max, row_sum = _block_fwd(qg, k, v, _visible(q_side, k_side), precision)
        merged = out
    else:
        out, row_max, row_sum = jax.lax.map(
            lambda a: _block_fwd(a[0], k, v, _visible(a[1], k_side), precision),
            (_query_chunks(qg, 3, chunk), _query_chunks(q_side, 1, chunk)))
        merged = jnp.moveaxis(out, 0, 3)  # [B, K, G, n, chunk, D]
        merged = merged.reshape(*merged.shape[:3], -1, merged.shape[-1])[:, :, :, :t]
    return _ungrouped(merged.astype(v.dtype)), (q, k, v, q_side, k_side, out, row_max, row_sum)


def _attention_bwd(chunk, precision, res, d_out):
    q, k, v, q_side, k_side, out, row_max, row_sum = res
    qg, d_out_g = _grouped(q, k.shape[1]), _grouped(d_out, k.shape[1])
    b, t, h, d = q.shape
    if t <= chunk:
        d_q, d_k, d_v = _block_bwd(qg, k, v, _visible(q_side, k_side), out, row_max, row_sum,
                                   d_out_g, precision)
    else:
        def step(carry, a):
            d_q, d_k, d_v = _block_bwd(a[0], k, v, _visible(a[1], k_side), *a[2:], precision)
            return (carry[0] + d_k, carry[1] + d_v), d_q

        zeros = jnp.zeros(k.shape, jnp.float32)
        (d_k, d_v), d_q = jax.lax.scan(step, (zeros, zeros), (
            _query_chunks(qg, 3, chunk), _query_chunks(q_side, 1, chunk), out, row_max, row_sum,
            _query_chunks(d_out_g, 3, chunk)))
        d_q = jnp.moveaxis(d_q, 0, 3)
        d_q = d_q.reshape(*d_q.shape[:3], -1, d)[:, :, :, :t]
    return _ungrouped(d_q).astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype), None, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _attention(q, k, v, q_side, k_side, chunk, precision):
    """Many-token attention (q [B, T, H, D], k/v [B, K, S, D]), `chunk` queries at a time, each
    chunk's mask built by `_visible` from the mask's query side (chunked with the queries) and
    key side: a mask [B, T, S] and None, or segments (see `_visible`). Its backward pass keeps
    q, k, v, the output and the softmax's row max and sum, and recomputes the probabilities,
    where autodiff would store two float32 [B, H, T, S] arrays per layer (2.1 GB for 8 layers,
    8 heads, 16 x 512 tokens) and transpose them."""
    return _attention_fwd(q, k, v, q_side, k_side, chunk, precision)[0]


_attention.defvjp(_attention_fwd, _attention_bwd)


def _dense(x: jax.Array, w: jax.Array, n_in: int = 1,
           precision: jax.lax.Precision | None = None) -> jax.Array:
    """x [..., *in] @ w [*in, *out] -> [..., *out], with `n_in` contracted axes, as one 2-D matmul.

    XLA:CPU lowers the weight gradient of a 3-D einsum such as "bte,ef->btf" with a physical
    transpose of the whole [B*T, F] activation gradient (a third of a train step's time at
    16 x 512 tokens); the same product on [B*T, E] x [E, F] needs none.
    """
    lead, inner, outer = x.shape[:x.ndim - n_in], w.shape[:n_in], w.shape[n_in:]
    y = jnp.matmul(x.reshape(math.prod(lead), math.prod(inner)),
                   w.reshape(math.prod(inner), math.prod(outer)), precision=precision)
    return y.reshape(*lead, *outer)


def embed(params: dict, tokens: jax.Array) -> jax.Array:
    """Token embeddings [B, T, E] of tokens int32 [B, T]."""
    return params["embed"][tokens]


def final_norm(params: dict, config: ModelConfig, x: jax.Array) -> jax.Array:
    return rms_norm(x, params["final_norm"], config.rms_norm_eps)


def decoder_layer(config: ModelConfig, p: dict, x: jax.Array, positions: jax.Array,
                  mask: jax.Array | None, attend: Attend | None = None, *,
                  lengths: jax.Array | None = None, segments: Segments | None = None
                  ) -> jax.Array:
    """One pre-norm block, x [B, T, E] -> [B, T, E] in the compute dtype, for one layer's params
    `p` (x and the weights are cast to `config.dtype` here: no-ops when they already are).

    positions [B, T] int32. Without `attend` the keys are this call's own tokens: mask [B, T, T]
    says which keys each query sees, or None for causal self-attention over packed rows of
    `segments` or right-padded rows of `lengths` real tokens (see `attention`). With `attend`,
    it computes the attention (see `Attend`) and `mask`, `lengths` and `segments` are not used.
    """
    p = jax.tree.map(lambda w: w.astype(config.jnp_dtype), p)
    x = x.astype(config.jnp_dtype)
    dense = functools.partial(_dense, precision=config.precision)
    h = rms_norm(x, p["attn_norm"], config.rms_norm_eps)
    q, k, v = dense(h, p["q"]), dense(h, p["k"]), dense(h, p["v"])
    if config.attention_bias:
        q, k, v = q + p["q_bias"], k + p["k_bias"], v + p["v_bias"]
    if config.qk_norm:
        q = rms_norm(q, p["q_norm"], config.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], config.rms_norm_eps)
    q = apply_rope(q, positions, config.rope_theta)
    k = apply_rope(k, positions, config.rope_theta)
    k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, K, T, D]
    if attend is None:
        out = attention(q, k, v, mask, lengths=lengths, segments=segments,
                        precision=config.precision)
    else:
        out = attend(q, k, v)
    x = x + dense(out, p["o"], n_in=2)

    h = rms_norm(x, p["mlp_norm"], config.rms_norm_eps)
    gated = jax.nn.silu(dense(h, p["gate"])) * dense(h, p["up"])
    return x + dense(gated, p["down"])


def _keep_projections_and_attention(prim, *args, **params) -> bool:
    """The layer's checkpoint policy without remat: keep the projections' outputs and the
    attention kernel's forward outputs (cuDNN's call, a Pallas kernel: splash attention on a
    TPU; the block kernel's output and softmax statistics on other GPUs and long CPU rows), and
    recompute the elementwise ops between them. Left to itself, autodiff stacks about six
    [B*T, intermediate] MLP arrays a layer; keeping less runs attention's forward twice a layer
    (the compiled H100 update: 1.23x the model's FLOPs against 1.11x, for 4.8 GB more at 3 rows
    of 10,240 tokens, docs/accelerators.md). Attention scored whole (short CPU rows) is
    recomputed: its intermediates are [T, T] scores."""
    return prim.name in _ATTENTION_KERNEL_FORWARDS or _PROJECTIONS_AND_BLOCK_KERNEL(prim, *args, **params)


# cuDNN's forward (its outputs: attention's and the softmax statistics its backward reads) and
# a Pallas kernel (in the training forward, only splash attention's forward is one).
_ATTENTION_KERNEL_FORWARDS = (_cudnn_attention._dot_product_attention_fwd_p_wrapper.name, "pallas_call")
_PROJECTIONS_AND_BLOCK_KERNEL = jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    jax.checkpoint_policies.save_only_these_names(KEPT_NAME))


def run_decoder(params: dict, config: ModelConfig, tokens: jax.Array, positions: jax.Array,
                mask: jax.Array | None, remat: bool = False, lengths: jax.Array | None = None,
                segments: Segments | None = None) -> jax.Array:
    """Embeds tokens [B, T] and runs all layers (a `lax.scan` over the stacked layer weights):
    returns final-normed hidden [B, T, E] in the compute dtype. `mask` [B, T, T] says which
    tokens each token sees, or None: causal within `segments` or over `lengths` (see
    `attention`)."""
    def layer(x, p):
        return decoder_layer(config, p, x, positions, mask, lengths=lengths,
                             segments=segments), None

    # remat: keep only each layer's input for the backward pass and recompute the rest.
    layer = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable if remat
                           else _keep_projections_and_attention)
    x, _ = jax.lax.scan(layer, embed(params, tokens).astype(config.jnp_dtype), params["layers"])
    return final_norm(params, config, x)


def output_head(params: dict, config: ModelConfig) -> jax.Array:
    """The [E, V] matrix mapping final hidden states to logits."""
    return params["embed"].T if config.tie_embeddings else params["lm_head"]


def logits_from_hidden(params: dict, config: ModelConfig, hidden: jax.Array) -> jax.Array:
    """float32 logits [..., V] from final hidden states [..., E]. The head is cast to hidden's
    dtype here, so a chunked caller's gradient of it is summed over chunks in its own dtype."""
    return _logits(hidden, output_head(params, config).astype(hidden.dtype), config.precision)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _logits(hidden, head, precision):
    """hidden [..., E] @ head [E, V] -> float32 [..., V], accumulated in float32. The backward
    pass multiplies in hidden's dtype as well: autodiff would pair the float32 cotangent with
    the bfloat16 operand, a float32 product on an accelerator, and the largest of the step."""
    return jnp.einsum("...e,ev->...v", hidden, head, precision=precision,
                      preferred_element_type=jnp.float32)


def _logits_fwd(hidden, head, precision):
    return _logits(hidden, head, precision), (hidden, head)


def _logits_bwd(precision, res, d_logits):
    hidden, head = res
    d_logits = d_logits.astype(hidden.dtype)
    d_hidden = jnp.einsum("...v,ev->...e", d_logits, head, precision=precision,
                          preferred_element_type=jnp.float32)
    d_head = jnp.einsum("...e,...v->ev", hidden, d_logits, precision=precision,
                        preferred_element_type=jnp.float32)
    return d_hidden.astype(hidden.dtype), d_head.astype(head.dtype)


_logits.defvjp(_logits_fwd, _logits_bwd)


def hidden_states(params: dict, config: ModelConfig, tokens: jax.Array,
                  attention_mask: jax.Array | None = None, *, lengths: jax.Array | None = None,
                  segment_lengths: jax.Array | None = None, remat: bool = False) -> jax.Array:
    """Final-normed hidden states [B, T, E] of a full causal pass (see `forward`)."""
    t = tokens.shape[1]
    if sum(x is not None for x in (attention_mask, lengths, segment_lengths)) > 1:
        raise ValueError("give one of attention_mask, lengths and segment_lengths, not both")
    if segment_lengths is not None:
        segments = packed_segments(segment_lengths, t)
        return run_decoder(params, config, tokens, segments.positions, None, remat=remat,
                           segments=segments)
    if attention_mask is None:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), tokens.shape)
        return run_decoder(params, config, tokens, positions, None, remat=remat, lengths=lengths)
    real = attention_mask.astype(bool)
    positions = jnp.maximum(jnp.cumsum(real, axis=1) - 1, 0)
    causal = jnp.tril(jnp.ones((t, t), bool))
    mask = causal[None] & real[:, None, :]  # [B, T, S=T]
    return run_decoder(params, config, tokens, positions, mask, remat=remat)


@functools.partial(jax.jit, static_argnames=("config", "remat"))
def forward(params: dict, config: ModelConfig, tokens: jax.Array,
            attention_mask: jax.Array | None = None, *, lengths: jax.Array | None = None,
            segment_lengths: jax.Array | None = None, remat: bool = False) -> jax.Array:
    """Full causal forward: tokens int32 [B, T] -> float32 logits [B, T, V].

    Padding, either way (default: every token real):
      attention_mask [B, T]  1 = real token, 0 = pad, on either side; real tokens get positions
                             cumsum(mask) - 1;
      lengths [B] int32      right-padded rows whose first lengths[b] tokens are real: the
                             fused causal attention kernel where the backend has one (the
                             right-padded training path; `attention`);
      segment_lengths [B, M] packed rows: the lengths of the sequences laid end to end from
                             each row's start (0 for an unused slot); each attends only to
                             itself, with positions from 0; the tokens after the last are one
                             more (padding) sequence (`packed_segments`).
    `remat` recomputes each layer in the backward pass instead of storing its activations.
    Computes in `config.dtype` from params of any float dtype (see `ModelConfig`).
    """
    return logits_from_hidden(params, config, hidden_states(
        params, config, tokens, attention_mask, lengths=lengths, segment_lengths=segment_lengths,
        remat=remat))
