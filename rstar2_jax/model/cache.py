"""KV-cache decoding: prefill a chunk of new tokens per row, or decode one token, in one function.

Every row of the cache is a contiguous history: row b holds positions 0 .. lengths[b]-1 in slots
0 .. lengths[b]-1 (no left padding), so a token's position is its slot index. Rows advance
independently (per-row write offsets), which lets a sampler pause one row for a tool call and
later prefill only the tool's tokens into that row while the others keep decoding.

The cache keeps one array per layer, laid out [batch, kv_heads, slots, head_dim], and the cached
forward loops over layers in Python. Both choices are for speed: slicing a layer out of stacked
[layers, ...] weights or caches inside a loop copies it on XLA:CPU (the whole cache and all the
weights at every decode step), and with kv heads ahead of slots the attention reads each head's
keys and values as contiguous blocks. `decode_layout` unstacks the weights once for a decode loop.
"""
from __future__ import annotations

import functools

import flax
import jax
import jax.numpy as jnp

from rstar2_jax.model.config import ModelConfig
from rstar2_jax.model.transformer import decoder_layer, embed, final_norm, logits_from_hidden


@flax.struct.dataclass
class KVCache:
    """Keys/values of every layer for every row, and how many tokens each row holds.

    k, v     tuples of num_layers arrays, each [batch, num_kv_heads, max_len, head_dim]
             (keys after RoPE)
    lengths  [batch] int32: row b holds positions 0 .. lengths[b]-1 in its first slots
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    """An empty cache (all lengths 0) in `dtype` (default: the model's dtype)."""
    shape = (batch, config.num_kv_heads, max_len, config.head_dim)
    dtype = dtype or config.jnp_dtype
    def zeros():  # a buffer per layer and per k/v: buffers are donated and updated in place
        return tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))

    return KVCache(k=zeros(), v=zeros(), lengths=jnp.zeros((batch,), jnp.int32))


def decode_layout(params: dict) -> dict:
    """`params` with `layers` as a list of per-layer pytrees (a copy of the stacked weights).

    `forward_cached` accepts either layout; a decode loop converts once, outside the loop, so
    that its steps read each layer's weights in place. Params without stacked layers (already
    converted, or a stand-in policy's) are returned as they are.
    """
    layers = params.get("layers")
    if not isinstance(layers, dict):
        return params
    num_layers = jax.tree.leaves(layers)[0].shape[0]
    return dict(params, layers=[jax.tree.map(lambda w, i=i: w[i], layers) for i in range(num_layers)])


@functools.partial(jax.jit, static_argnames=("config", "last_only"))
def forward_cached(params: dict, config: ModelConfig, tokens: jax.Array, cache: KVCache,
                   num_new: jax.Array | None = None, *, last_only: bool = False):
    """Appends new tokens to each row's cache and returns their logits.

    params   the model's params, layers stacked or as a list (see `decode_layout`)
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
    max_len = cache.max_len
    if num_new is None:
        num_new = jnp.full((batch,), t, jnp.int32)
    offsets = jnp.arange(t)
    positions = cache.lengths[:, None] + offsets  # [B, T]
    mask = jnp.arange(max_len)[None, None, :] <= positions[:, :, None]  # [B, T, S]
    # Pad tokens get an out-of-range slot, which the scatter drops: they never touch the cache.
    slots = jnp.where(offsets < num_new[:, None], positions, max_len)[:, None, :]  # [B, 1, T]
    rows = jnp.arange(batch)[:, None, None]
    heads = jnp.arange(config.num_kv_heads)[None, :, None]

    def write(cache_layer: jax.Array, new: jax.Array) -> jax.Array:
        """Scatters new [B, K, T, D] into a layer's [B, K, S, D] cache, in place."""
        return cache_layer.at[rows, heads, slots].set(new.astype(cache_layer.dtype), mode="drop")

    x = embed(params, tokens)
    new_k, new_v = [], []
    for i, layer in enumerate(decode_layout(params)["layers"]):
        def attend_to(k, v, i=i):
            new_k.append(write(cache.k[i], k))
            new_v.append(write(cache.v[i], v))
            return new_k[-1], new_v[-1]

        x = decoder_layer(config, layer, x, positions, mask, attend_to)
    hidden = final_norm(params, config, x)
    if last_only:
        hidden = hidden[jnp.arange(batch), jnp.maximum(num_new - 1, 0)]  # [B, E]
    new_cache = KVCache(k=tuple(new_k), v=tuple(new_v), lengths=cache.lengths + num_new)
    return logits_from_hidden(params, config, hidden), new_cache


@jax.jit
def copy_rows(cache: KVCache, source: KVCache, src_rows: jax.Array, dst_rows: jax.Array) -> KVCache:
    """Copies `source` rows src_rows[i] into `cache` rows dst_rows[i] (int32 [N] each).

    `source` may be shorter (fewer slots) than `cache`, e.g. a staging cache of prompts; its rows
    then fill the first slots. If it is longer, only its first `cache.max_len` slots are copied:
    the caller must make sure the copied rows fit. Out-of-range dst_rows entries are dropped
    (padding).
    """
    width = min(source.max_len, cache.max_len)

    def copy(into, rows):
        rows = rows[:, :, :width]
        return into.at[dst_rows, :, :width].set(rows[src_rows], mode="drop")

    return KVCache(k=tuple(map(copy, cache.k, source.k)), v=tuple(map(copy, cache.v, source.v)),
                   lengths=cache.lengths.at[dst_rows].set(source.lengths[src_rows], mode="drop"))


@functools.partial(jax.jit, static_argnames=("max_len",))
def resize_cache(cache: KVCache, max_len: int) -> KVCache:
    """The cache with `max_len` slots per row: zero slots appended, or trailing slots dropped.

    Dropping is safe only for slots past every row's length that the caller still needs.
    """
    def resize(layer):
        if max_len <= layer.shape[2]:
            return layer[:, :, :max_len]
        return jnp.pad(layer, ((0, 0), (0, 0), (0, max_len - layer.shape[2]), (0, 0)))

    return cache.replace(k=tuple(map(resize, cache.k)), v=tuple(map(resize, cache.v)))
