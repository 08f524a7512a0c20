"""The Qwen2 / Qwen3 decoder as pure functions of the params pytree (see `params.py`).

Shapes: B batch, T query tokens, S key slots, E hidden, H query heads, K kv heads, D head dim,
V vocab. Activations between layers are in `config.dtype`; RMSNorm, RoPE angles, attention
scores/softmax and logits are float32.

Padding: `forward` takes `attention_mask [B, T]` (1 = real token) and gives each real token the
position `cumsum(mask) - 1`, so left- and right-padded batches both give the same logits at real
positions as the unpadded rows would. Logits at pad positions are garbage (finite, never NaN).
"""
from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp

from rstar2_jax.model.config import ModelConfig

# A finite "minus infinity": a query with no visible key (a left pad) then gets a uniform
# softmax instead of NaN, so its garbage never poisons gradients through masked sums.
_MASKED = float(jnp.finfo(jnp.float32).min)

# Called by a layer with its new keys/values [B, K, T, D]; returns the keys/values to attend to,
# [B, K, S, D] (a cache stores the new ones and returns all it holds).
AttendTo = Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, normalised in float32; returns x's dtype. x [..., N], scale [N]."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    # Like transformers: cast back before the scale, so bf16 models round at the same place.
    return scale * normed.astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding, rotating the two halves of the head dim. x [B, T, N, D], positions [B, T]."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)  # [D/2]
    angles = positions.astype(jnp.float32)[:, :, None, None] * inv_freq  # [B, T, 1, D/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query attention. q [B, T, H, D], k/v [B, K, S, D], mask [B, T, S] bool -> [B, T, H, D].

    Many-token attention (prefill, training) has a hand-written backward pass (`_attention_bwd`):
    it keeps q, k, v, the output and the softmax's row max and sum, and recomputes the
    probabilities, where autodiff would store two float32 [B, H, T, S] arrays per layer (2.1 GB
    for 8 layers, 8 heads, 16 x 512 tokens) and transpose them. A decode step (T = 1) takes
    `_decode_attention`.
    """
    if q.shape[1] == 1:
        return _decode_attention(q, k, v, mask)
    return _attention(q, k, v, mask)


def _decode_attention(q, k, v, mask):
    """`attention` of one query token per row. XLA:CPU runs it ~2x faster with the key slots
    ahead of the query heads in the scores ([B, K, S, G]) than in the many-token order."""
    b, _, h, d = q.shape
    kv_heads = k.shape[1]
    q = q.reshape(b, kv_heads, h // kv_heads, d)  # [B, K, G, D]: query head h reads kv head h // G
    scores = jnp.einsum("bkgd,bksd->bksg", q, k, preferred_element_type=jnp.float32) * d**-0.5
    scores = jnp.where(mask[:, 0, None, :, None], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=2).astype(v.dtype)
    return jnp.einsum("bksg,bksd->bkgd", probs, v).reshape(b, 1, h, d)


def _grouped(x, kv_heads):
    """Per-query-head x [B, T, H, D] -> [B, K, G, T, D]: query head h reads kv head h // G."""
    b, t, h, d = x.shape
    return x.reshape(b, t, kv_heads, h // kv_heads, d).transpose(0, 2, 3, 1, 4)


def _ungrouped(x):
    """[B, K, G, T, D] -> [B, T, H, D]."""
    b, kv_heads, group, t, d = x.shape
    return x.transpose(0, 3, 1, 2, 4).reshape(b, t, kv_heads * group, d)


def _masked_scores(q, k, mask):
    """float32 scaled scores [B, K, G, T, S] of grouped q and k, _MASKED where mask is False."""
    scores = jnp.einsum("bkgtd,bksd->bkgts", q, k, preferred_element_type=jnp.float32)
    return jnp.where(mask[:, None, None], scores * q.shape[-1]**-0.5, _MASKED)


def _attention_fwd(q, k, v, mask):
    qg = _grouped(q, k.shape[1])
    scores = _masked_scores(qg, k, mask)
    # jax.nn.softmax, keeping its row max and sum for the backward pass.
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    unnormalized = jnp.exp(scores - row_max)
    row_sum = jnp.sum(unnormalized, axis=-1, keepdims=True)
    probs = (unnormalized / row_sum).astype(v.dtype)
    out = jnp.einsum("bkgts,bksd->bkgtd", probs, v, preferred_element_type=jnp.float32)
    return _ungrouped(out.astype(v.dtype)), (q, k, v, mask, out, row_max, row_sum)


def _attention_bwd(res, d_out):
    q, k, v, mask, out, row_max, row_sum = res  # out: float32 [B, K, G, T, D]
    kv_heads = k.shape[1]
    qg = _grouped(q, kv_heads)
    probs = jnp.exp(_masked_scores(qg, k, mask) - row_max) / row_sum  # float32 [B, K, G, T, S]
    d_out_g = _grouped(d_out, kv_heads)
    d_v = jnp.einsum("bkgts,bkgtd->bksd", probs.astype(v.dtype), d_out_g)
    d_probs = jnp.einsum("bkgtd,bksd->bkgts", d_out_g, v, preferred_element_type=jnp.float32)
    # Softmax backward, with sum_s probs * d_probs = sum_d out * d_out (no pass over [T, S]).
    # Masked scores get no gradient: a fully masked row's uniform probabilities must not leak.
    row_dot = jnp.sum(out * d_out_g.astype(jnp.float32), axis=-1, keepdims=True)
    d_scores = jnp.where(mask[:, None, None], probs * (d_probs - row_dot), 0.0)
    d_scores = (d_scores * q.shape[-1]**-0.5).astype(q.dtype)
    d_q = _ungrouped(jnp.einsum("bkgts,bksd->bkgtd", d_scores, k))
    d_k = jnp.einsum("bkgts,bkgtd->bksd", d_scores, qg)
    return d_q, d_k, d_v, None


@jax.custom_vjp
def _attention(q, k, v, mask):
    return _attention_fwd(q, k, v, mask)[0]


_attention.defvjp(_attention_fwd, _attention_bwd)


def _dense(x: jax.Array, w: jax.Array, n_in: int = 1) -> jax.Array:
    """x [..., *in] @ w [*in, *out] -> [..., *out], with `n_in` contracted axes, as one 2-D matmul.

    XLA:CPU lowers the weight gradient of a 3-D einsum such as "bte,ef->btf" with a physical
    transpose of the whole [B*T, F] activation gradient (a third of a train step's time at
    16 x 512 tokens); the same product on [B*T, E] x [E, F] needs none.
    """
    lead, inner, outer = x.shape[:x.ndim - n_in], w.shape[:n_in], w.shape[n_in:]
    y = x.reshape(math.prod(lead), math.prod(inner)) @ w.reshape(math.prod(inner), math.prod(outer))
    return y.reshape(*lead, *outer)


def embed(params: dict, tokens: jax.Array) -> jax.Array:
    """Token embeddings [B, T, E] of tokens int32 [B, T]."""
    return params["embed"][tokens]


def final_norm(params: dict, config: ModelConfig, x: jax.Array) -> jax.Array:
    return rms_norm(x, params["final_norm"], config.rms_norm_eps)


def decoder_layer(config: ModelConfig, p: dict, x: jax.Array, positions: jax.Array,
                  mask: jax.Array, attend_to: AttendTo | None = None) -> jax.Array:
    """One pre-norm block, x [B, T, E] -> [B, T, E], for one layer's params `p`.

    positions [B, T] int32; mask [B, T, S] says which keys each query sees. Without `attend_to`
    the keys are this call's own tokens (S = T); with it, whatever it returns (see `AttendTo`).
    """
    h = rms_norm(x, p["attn_norm"], config.rms_norm_eps)
    q, k, v = _dense(h, p["q"]), _dense(h, p["k"]), _dense(h, p["v"])
    if config.attention_bias:
        q, k, v = q + p["q_bias"], k + p["k_bias"], v + p["v_bias"]
    if config.qk_norm:
        q = rms_norm(q, p["q_norm"], config.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], config.rms_norm_eps)
    q = apply_rope(q, positions, config.rope_theta)
    k = apply_rope(k, positions, config.rope_theta)
    k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, K, T, D]
    if attend_to is not None:
        k, v = attend_to(k, v)
        # The cache may be stored in another dtype than the model computes in.
        k, v = k.astype(q.dtype), v.astype(q.dtype)
    x = x + _dense(attention(q, k, v, mask), p["o"], n_in=2)

    h = rms_norm(x, p["mlp_norm"], config.rms_norm_eps)
    gated = jax.nn.silu(_dense(h, p["gate"])) * _dense(h, p["up"])
    return x + _dense(gated, p["down"])


def run_decoder(params: dict, config: ModelConfig, tokens: jax.Array, positions: jax.Array,
                mask: jax.Array, remat: bool = False) -> jax.Array:
    """Embeds tokens [B, T] and runs all layers (a `lax.scan` over the stacked layer weights):
    returns final-normed hidden [B, T, E]. `mask` [B, T, T] says which tokens each token sees."""
    def layer(x, p):
        return decoder_layer(config, p, x, positions, mask), None

    # remat: keep only each layer's input for the backward pass and recompute the rest.
    # Otherwise keep the projections' outputs and recompute the elementwise ops between them:
    # left to itself, autodiff stacks about six [B*T, intermediate] MLP arrays per layer.
    layer = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable if remat
                           else jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    x, _ = jax.lax.scan(layer, embed(params, tokens), params["layers"])
    return final_norm(params, config, x)


def output_head(params: dict, config: ModelConfig) -> jax.Array:
    """The [E, V] matrix mapping final hidden states to logits."""
    return params["embed"].T if config.tie_embeddings else params["lm_head"]


def logits_from_hidden(params: dict, config: ModelConfig, hidden: jax.Array) -> jax.Array:
    """float32 logits [..., V] from final hidden states [..., E]."""
    return jnp.einsum("...e,ev->...v", hidden, output_head(params, config),
                      preferred_element_type=jnp.float32)


def hidden_states(params: dict, config: ModelConfig, tokens: jax.Array,
                  attention_mask: jax.Array | None = None, *, remat: bool = False) -> jax.Array:
    """Final-normed hidden states [B, T, E] of a full causal pass (see `forward`)."""
    if attention_mask is None:
        attention_mask = jnp.ones(tokens.shape, jnp.int32)
    real = attention_mask.astype(bool)
    positions = jnp.maximum(jnp.cumsum(real, axis=1) - 1, 0)
    t = tokens.shape[1]
    causal = jnp.tril(jnp.ones((t, t), bool))
    mask = causal[None] & real[:, None, :]  # [B, T, S=T]
    return run_decoder(params, config, tokens, positions, mask, remat=remat)


@functools.partial(jax.jit, static_argnames=("config", "remat"))
def forward(params: dict, config: ModelConfig, tokens: jax.Array,
            attention_mask: jax.Array | None = None, *, remat: bool = False) -> jax.Array:
    """Full causal forward: tokens int32 [B, T] -> float32 logits [B, T, V].

    attention_mask [B, T] (1 = real token, 0 = pad; default all real). Pads may be on either
    side; real tokens get positions cumsum(mask) - 1. `remat` recomputes each layer in the
    backward pass instead of storing its activations.
    """
    return logits_from_hidden(params, config,
                              hidden_states(params, config, tokens, attention_mask, remat=remat))
