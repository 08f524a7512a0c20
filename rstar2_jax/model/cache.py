"""KV-cache decoding: prefill a chunk of new tokens per row, or decode one token, in one function.

Every row of the cache is a contiguous history: row b holds positions 0 .. lengths[b]-1 in slots
0 .. lengths[b]-1 (no left padding), so a token's position is its slot index. Rows advance
independently (per-row write offsets), which lets a sampler pause one row for a tool call and
later prefill only the tool's tokens into that row while the others keep decoding.
"""
from __future__ import annotations

import functools

import flax
import jax
import jax.numpy as jnp

from rstar2_jax.model.config import ModelConfig
from rstar2_jax.model.transformer import StackedKV, logits_from_hidden, run_decoder


@flax.struct.dataclass
class KVCache:
    """Keys/values of every layer for every row, and how many tokens each row holds.

    k, v     [num_layers, batch, max_len, num_kv_heads, head_dim], keys after RoPE
    lengths  [batch] int32: row b holds positions 0 .. lengths[b]-1 in its first slots
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    """An empty cache (all lengths 0) in `dtype` (default: the model's dtype)."""
    shape = (config.num_layers, batch, max_len, config.num_kv_heads, config.head_dim)
    dtype = dtype or config.jnp_dtype
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   lengths=jnp.zeros((batch,), jnp.int32))


@functools.partial(jax.jit, static_argnames=("config", "last_only"))
def forward_cached(params: dict, config: ModelConfig, tokens: jax.Array, cache: KVCache,
                   num_new: jax.Array | None = None, *, last_only: bool = False):
    """Appends new tokens to each row's cache and returns their logits.

    tokens   int32 [B, T]: new tokens, right-padded within the chunk (T = 1 is a decode step)
    num_new  int32 [B]: how many of each row's T tokens are real (default T). 0 leaves the row's
             cache unchanged.
    Row b writes its real tokens to slots lengths[b] .. lengths[b] + num_new[b] - 1 at those
    positions; token t attends to slots 0 .. lengths[b] + t. The caller must keep
    lengths + num_new <= max_len: writes past the end are dropped and lengths then overstate
    what the row holds.

    Returns (logits, new_cache) with new_cache.lengths = lengths + num_new. logits are float32
    [B, T, V], or with `last_only` [B, V] at each row's last real token (garbage for rows with
    num_new = 0). Logits at pad tokens are garbage.
    """
    batch, t = tokens.shape
    max_len = cache.k.shape[2]
    if num_new is None:
        num_new = jnp.full((batch,), t, jnp.int32)
    offsets = jnp.arange(t)
    positions = cache.lengths[:, None] + offsets  # [B, T]
    mask = jnp.arange(max_len)[None, None, :] <= positions[:, :, None]  # [B, T, S]
    # Pad tokens get an out-of-range slot, which the scatter drops: they never touch the cache.
    slots = jnp.where(offsets < num_new[:, None], positions, max_len)
    rows = jnp.arange(batch)[:, None]

    def write_kv(kv: StackedKV, layer: jax.Array, k: jax.Array, v: jax.Array) -> StackedKV:
        k_cache, v_cache = kv
        return (k_cache.at[layer, rows, slots].set(k.astype(k_cache.dtype), mode="drop"),
                v_cache.at[layer, rows, slots].set(v.astype(v_cache.dtype), mode="drop"))

    hidden, (k, v) = run_decoder(params, config, tokens, positions, mask, (cache.k, cache.v), write_kv)
    if last_only:
        hidden = hidden[jnp.arange(batch), jnp.maximum(num_new - 1, 0)]  # [B, E]
    return logits_from_hidden(params, config, hidden), KVCache(k=k, v=v, lengths=cache.lengths + num_new)


@jax.jit
def copy_cache_rows(cache: KVCache, src_rows: jax.Array, dst_rows: jax.Array) -> KVCache:
    """Copies rows src_rows[i] -> dst_rows[i] (int32 [N] each), e.g. one prompt prefill to G samples."""
    return KVCache(k=cache.k.at[:, dst_rows].set(cache.k[:, src_rows]),
                   v=cache.v.at[:, dst_rows].set(cache.v[:, src_rows]),
                   lengths=cache.lengths.at[dst_rows].set(cache.lengths[src_rows]))
