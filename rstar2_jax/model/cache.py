"""KV-cache decoding in pages: prefill a chunk of new tokens per row, or decode one token.

The cache is a pool of fixed-size pages shared by all rows, and a block table per row: row b's
token at position p lives in page `block_table[b, p // page_size]`, at offset
`p % page_size`. Rows advance independently (per-row write offsets), which lets a sampler pause
one row for a tool call and later prefill only the tool's tokens into it while the others keep
decoding; and a row holds only the pages its tokens fill, so many short rows and a few long ones
share the memory (pages of a common prompt can even be shared by several rows: a row only ever
writes past its own length). A contiguous cache is the special case of one page per row
(`init_cache`).

Layout: one array per layer, [num_pages, kv_heads, page_size, head_dim]. A row's pages are
gathered into [batch, kv_heads, slots, head_dim] for attention, so each kv head's keys and values
are contiguous blocks; the cached forward loops over layers in Python, because slicing a layer
out of stacked [layers, ...] weights or caches inside a loop copies it on XLA:CPU (the whole cache
and all the weights at every decode step). `decode_layout` unstacks the weights once for a decode
loop.
"""
from __future__ import annotations

import functools

import flax
import jax
import jax.numpy as jnp

from rstar2_jax.model.config import ModelConfig
from rstar2_jax.model.transformer import (
    attention,
    decoder_layer,
    embed,
    final_norm,
    logits_from_hidden,
)


@flax.struct.dataclass
class KVCache:
    """Keys/values of every layer in pages, each row's pages, and how many tokens each row holds.

    k, v         tuples of num_layers arrays, each [num_pages, num_kv_heads, page_size, head_dim]
                 (keys after RoPE)
    block_table  [batch, pages_per_row] int32: the pages of row b in position order; entries past
                 the row's last page are never read unmasked (any page id will do)
    lengths      [batch] int32: row b holds positions 0 .. lengths[b]-1
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    block_table: jax.Array
    lengths: jax.Array

    @property
    def page_size(self) -> int:
        return self.k[0].shape[2]

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0]

    @property
    def max_len(self) -> int:
        """Positions a row can address through its block table."""
        return self.block_table.shape[1] * self.page_size


def empty_pages(config: ModelConfig, num_pages: int, page_size: int, dtype=None):
    """Zeroed page pools `(k, v)`, each a tuple of num_layers [num_pages, kv_heads, page_size,
    head_dim] arrays in `dtype` (default: the model's dtype)."""
    shape = (num_pages, config.num_kv_heads, page_size, config.head_dim)
    dtype = dtype or config.jnp_dtype

    def zeros():  # a buffer per layer and per k/v: buffers are donated and updated in place
        return tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))

    return zeros(), zeros()


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    """An empty contiguous cache: one page of `max_len` slots per row, all lengths 0."""
    k, v = empty_pages(config, batch, max_len, dtype)
    return KVCache(k=k, v=v, block_table=jnp.arange(batch, dtype=jnp.int32)[:, None],
                   lengths=jnp.zeros((batch,), jnp.int32))


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


def write_tokens(cache: KVCache, layer: jax.Array, new: jax.Array, num_new: jax.Array) -> jax.Array:
    """Scatters new [B, K, T, D] into a layer's pages at positions lengths .. lengths + T - 1;
    tokens past `num_new` [B] (pads) and past a row's block table are dropped."""
    t = new.shape[2]
    positions = cache.lengths[:, None] + jnp.arange(t)  # [B, T]
    table_width = cache.block_table.shape[1]
    index = jnp.minimum(positions // cache.page_size, table_width - 1)
    page = jnp.take_along_axis(cache.block_table, index, axis=1)
    keep = (jnp.arange(t) < num_new[:, None]) & (positions < cache.max_len)
    page = jnp.where(keep, page, cache.num_pages)[:, None, :]  # out of range: dropped
    offset = (positions % cache.page_size)[:, None, :]
    heads = jnp.arange(layer.shape[1])[None, :, None]
    return layer.at[page, heads, offset].set(new.astype(layer.dtype), mode="drop")


def read_rows(cache: KVCache, layer: jax.Array) -> jax.Array:
    """Each row's slots [B, K, pages_per_row * page_size, D], gathered from a layer's pages."""
    num_pages, heads, page_size, dim = layer.shape
    batch, width = cache.block_table.shape
    # Pages and heads flattened together, so that the gather lands in [B, K, W, P, D] order
    # and the reshape to [B, K, S, D] moves nothing.
    index = cache.block_table[:, None, :] * heads + jnp.arange(heads)[None, :, None]
    rows = layer.reshape(num_pages * heads, page_size, dim)[index]
    return rows.reshape(batch, heads, width * page_size, dim)


@functools.partial(jax.jit, static_argnames=("config", "last_only"))
def forward_cached(params: dict, config: ModelConfig, tokens: jax.Array, cache: KVCache,
                   num_new: jax.Array | None = None, *, last_only: bool = False):
    """Appends new tokens to each row's cache and returns their logits.

    params   the model's params, layers stacked or as a list (see `decode_layout`)
    tokens   int32 [B, T]: new tokens, right-padded within the chunk (T = 1 is a decode step)
    num_new  int32 [B]: how many of each row's T tokens are real (default T). 0 leaves the row's
             cache unchanged.
    Row b writes its real tokens at positions lengths[b] .. lengths[b] + num_new[b] - 1, in the
    pages its block table names; token t attends to positions 0 .. lengths[b] + t. The caller
    must give each row pages up to lengths + num_new: writes past its block table are dropped and
    lengths then overstate what the row holds.

    Returns (logits, new_cache) with new_cache.lengths = lengths + num_new. logits are float32
    [B, T, V], or with `last_only` [B, V] at each row's last real token (garbage for rows with
    num_new = 0). Logits at pad tokens are garbage.
    """
    batch, t = tokens.shape
    if num_new is None:
        num_new = jnp.full((batch,), t, jnp.int32)
    positions = cache.lengths[:, None] + jnp.arange(t)  # [B, T]
    mask = jnp.arange(cache.max_len)[None, None, :] <= positions[:, :, None]  # [B, T, S]

    x = embed(params, tokens)
    new_k, new_v = [], []
    for i, layer in enumerate(decode_layout(params)["layers"]):
        def attend(q, k, v, i=i):
            new_k.append(write_tokens(cache, cache.k[i], k, num_new))
            new_v.append(write_tokens(cache, cache.v[i], v, num_new))
            # The cache may be stored in another dtype than the model computes in.
            k, v = (read_rows(cache, pages).astype(q.dtype) for pages in (new_k[-1], new_v[-1]))
            return attention(q, k, v, mask, precision=config.precision)

        x = decoder_layer(config, layer, x, positions, None, attend)
    hidden = final_norm(params, config, x)
    if last_only:
        hidden = hidden[jnp.arange(batch), jnp.maximum(num_new - 1, 0)]  # [B, E]
    new_cache = cache.replace(k=tuple(new_k), v=tuple(new_v), lengths=cache.lengths + num_new)
    return logits_from_hidden(params, config, hidden), new_cache


@functools.partial(jax.jit, donate_argnums=(0,))
def copy_pages(pages: tuple, src: jax.Array, dst: jax.Array) -> tuple:
    """`pages` (a pytree of page pools, e.g. `(k, v)`) with pages src[i] copied to dst[i]
    (int32 [N] each); out-of-range dst entries are dropped (padding)."""
    return jax.tree.map(lambda layer: layer.at[dst].set(layer[src], mode="drop"), pages)
