"""KV-cache decoding in pages: prefill a chunk of new tokens per row, or decode one token.

The cache is a pool of fixed-size pages shared by all rows, and a block table per row: row b's
token at position p lives in page `block_table[b, p // page_size]`, at offset
`p % page_size`. Rows advance independently (per-row write offsets), which lets a sampler pause
one row for a tool call and later prefill only the tool's tokens into it while the others keep
decoding; and a row holds only the pages its tokens fill, so many short rows and a few long ones
share the memory (pages of a common prompt can even be shared by several rows: a row only ever
writes past its own length). A contiguous cache is the special case of one page per row
(`init_cache`).

Layout: keys and values of all layers are one array each, [layers, num_pages, kv_heads,
page_size, head_dim]; a page of one layer (all its kv heads) is one contiguous block, the unit
every read gathers. The cached forward is one `lax.scan` over the stacked layer weights (one
layer to compile, whatever the depth) that carries the pools: each layer scatters its new keys
and values into them in place and gathers its rows' pages from them, so no per-layer slice of
a pool is ever copied (a caller that donates the pools, as the sampler's decode call does,
updates them in place).

A decode step (one token per row) attends in `attend_pages` on CPU: page by page up to the
longest row, each page of every row gathered into a cache-sized temporary. On a GPU with a
16-bit cache it attends by a kernel that reads each row's pages where they lie, up to its
length: cuDNN's paged attention on NVIDIA (`cudnn_attend_pages`), a Pallas Triton kernel on AMD
(`pallas_pages.pallas_attend_pages`). On a TPU the pools are laid out for ragged paged
attention (`tpu_attention.ragged_attend_pages`), which reads them where they lie too: keys and
values in one pool, [layers, num_pages, page_size, 2 x kv_heads, head_dim], interleaved on the
head axis (`interleaved_pages` says when). Elsewhere, and for prefill, each row's whole block
table is gathered into [B, kv_heads, slots, head_dim] and `attention` runs over it (on a GPU a
loop of small kernels per page would cost more than the copy). The target device, not the
process, decides (`target`).
"""
from __future__ import annotations

import functools
import logging
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
from jax._src.cudnn import fused_attention_stablehlo as _cudnn_attention

from rstar2_jax.model import target
from rstar2_jax.model.config import ModelConfig
from rstar2_jax.model.pallas_pages import pallas_attend_pages
from rstar2_jax.model.tpu_attention import ragged_attend_pages, ragged_kernel_supports
from rstar2_jax.model.transformer import (
    _cudnn_supports,
    attention,
    decoder_layer,
    embed,
    final_norm,
    logits_from_hidden,
)

log = logging.getLogger(__name__)


@flax.struct.dataclass
class KVCache:
    """Keys/values of every layer in pages, each row's pages, and how many tokens each row holds.

    k, v         [num_layers, num_pages, num_kv_heads, page_size, head_dim] (keys after RoPE);
                 or k [num_layers, num_pages, page_size, 2 * num_kv_heads, head_dim], keys and
                 values interleaved on its head axis (key head i at 2i, value head i at 2i + 1:
                 ragged paged attention's layout), and v None
    block_table  [batch, pages_per_row] int32: the pages of row b in position order; entries past
                 the row's last page are never read unmasked (any page id will do)
    lengths      [batch] int32: row b holds positions 0 .. lengths[b]-1
    dtype        (static) the keys' and values' dtype when k and v hold their bits (`as_bits`);
                 None: the pools' own dtype
    """

    k: jax.Array
    v: jax.Array
    block_table: jax.Array
    lengths: jax.Array
    dtype: Any = flax.struct.field(pytree_node=False, default=None)

    @property
    def kv_dtype(self):
        """The dtype of the keys and values (the pools may hold their bits)."""
        return jnp.dtype(self.dtype or self.k.dtype)

    @property
    def interleaved(self) -> bool:
        """Whether k holds keys and values interleaved (and v is None)."""
        return self.v is None

    @property
    def pools(self) -> tuple:
        """The page pools: (k, v), or (k,) when interleaved."""
        return (self.k,) if self.interleaved else (self.k, self.v)

    @classmethod
    def of_pools(cls, pools: tuple, block_table: jax.Array, lengths: jax.Array,
                 dtype=None) -> KVCache:
        """A cache over `pools` as `empty_pages` makes them ((k, v) or one interleaved pool)."""
        k, v = pools if len(pools) == 2 else (pools[0], None)
        return cls(k=k, v=v, block_table=block_table, lengths=lengths, dtype=dtype)

    @property
    def page_size(self) -> int:
        return self.k.shape[2 if self.interleaved else 3]

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        """Positions a row can address through its block table."""
        return self.block_table.shape[1] * self.page_size


def pool_shape(config: ModelConfig, num_pages: int, page_size: int,
               interleaved: bool = False) -> tuple[int, ...]:
    """The shape of the key (or value) pool: [layers, num_pages, kv_heads, page_size, head_dim];
    `interleaved`: of the one pool of both, [layers, num_pages, page_size, 2 * kv_heads,
    head_dim]."""
    if interleaved:
        return (config.num_layers, num_pages, page_size, 2 * config.num_kv_heads, config.head_dim)
    return (config.num_layers, num_pages, config.num_kv_heads, page_size, config.head_dim)


def interleaved_pages(config: ModelConfig, dtype=None) -> bool:
    """Whether a pool of `dtype` (default: the model's) holds keys and values interleaved, for
    ragged paged attention: for a TPU target (`target.current`) whose kernel takes the model's
    heads, head dim and `dtype` (`tpu_attention.ragged_kernel_supports`). Other TPU pools are
    gathered per row."""
    return target.current().platform == "tpu" and ragged_kernel_supports(
        config.num_heads, config.num_kv_heads, config.head_dim, dtype or config.jnp_dtype)


def empty_pages(config: ModelConfig, num_pages: int, page_size: int, dtype=None) -> tuple:
    """Zeroed page pools in `dtype` (default: the model's dtype) for the target's decode kernel:
    `(k, v)`, each `pool_shape`, or where `interleaved_pages` `(kv,)`, one pool of both
    (`KVCache`)."""
    dtype = dtype or config.jnp_dtype
    if interleaved_pages(config, dtype):
        return (jnp.zeros(pool_shape(config, num_pages, page_size, True), dtype),)
    shape = pool_shape(config, num_pages, page_size)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    """An empty contiguous cache: one page of `max_len` slots per row, all lengths 0."""
    k, v = empty_pages(config, batch, max_len, dtype)
    return KVCache(k=k, v=v, block_table=jnp.arange(batch, dtype=jnp.int32)[:, None],
                   lengths=jnp.zeros((batch,), jnp.int32))


def write_tokens(cache: KVCache, pool: jax.Array, layer, new: jax.Array,
                 num_new: jax.Array) -> jax.Array:
    """Scatters new [B, K, T, D] into `layer`'s pages of `pool` at positions lengths ..
    lengths + T - 1 (an interleaved cache's pool: new [B, 2K, T, D], keys and values
    interleaved); tokens past `num_new` [B] (pads) and past a row's block table are dropped."""
    t = new.shape[2]
    positions = cache.lengths[:, None] + jnp.arange(t)  # [B, T]
    table_width = cache.block_table.shape[1]
    index = jnp.minimum(positions // cache.page_size, table_width - 1)
    page = jnp.take_along_axis(cache.block_table, index, axis=1)
    keep = (jnp.arange(t) < num_new[:, None]) & (positions < cache.max_len)
    page = jnp.where(keep, page, cache.num_pages)[:, None, :]  # out of range: dropped
    offset = (positions % cache.page_size)[:, None, :]
    heads = jnp.arange(new.shape[1])[None, :, None]
    new = new.astype(cache.kv_dtype)
    if pool.dtype != new.dtype:  # a pool of bits (`as_bits`)
        new = jax.lax.bitcast_convert_type(new, pool.dtype)
    index = (layer, page, offset, heads) if cache.interleaved else (layer, page, heads, offset)
    return pool.at[index].set(new, mode="drop")


def as_bits(pool: jax.Array) -> jax.Array:
    """For a CPU target (`target.current`), a pool of 16-bit floats as its uint16 bits (a
    `KVCache` with `dtype` set); other pools, and every pool for other targets, as they are.

    XLA:CPU scatters 16-bit floats by converting the whole operand to float32 and back: the
    pools of every layer, at every layer of every decode step (bfloat16 decode 5-8x slower than
    float32). Bits are scattered and gathered as they are, and each gathered page is read back
    as floats (`read_pages`). Other backends scatter 16-bit floats in place, and a kernel that
    reads the pools where they lie (`cudnn_attend_pages`) takes them only as floats.
    """
    if (target.current().platform == "cpu" and pool.dtype.itemsize == 2
            and jnp.issubdtype(pool.dtype, jnp.floating)):
        return jax.lax.bitcast_convert_type(pool, jnp.uint16)
    return pool


def read_pages(pool: jax.Array, layer, table: jax.Array, dtype=None) -> jax.Array:
    """`layer`'s pages `table` [B, W] of `pool`: [B, W, K, page_size, D], in `dtype` when the
    pool holds its bits (`as_bits`)."""
    layers, num_pages, *page = pool.shape
    pages = pool.reshape(layers * num_pages, *page)[layer * num_pages + table]
    if dtype is not None and pages.dtype != dtype:
        pages = jax.lax.bitcast_convert_type(pages, dtype)
    return pages


def read_rows(cache: KVCache, pool: jax.Array, layer) -> jax.Array:
    """Each row's slots [B, K, pages_per_row * page_size, D], gathered from `layer`'s pages (of
    an interleaved cache's pool: [B, 2K, ...], keys and values interleaved)."""
    pages = read_pages(pool, layer, cache.block_table, cache.kv_dtype)  # [B, W, K, P, D]
    if cache.interleaved:  # [B, W, P, 2K, D]
        pages = pages.transpose(0, 1, 3, 2, 4)
    batch, width, heads, page_size, dim = pages.shape
    return pages.transpose(0, 2, 1, 3, 4).reshape(batch, heads, width * page_size, dim)


def attend_pages(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, layer,
                 table: jax.Array, lengths: jax.Array,
                 precision: jax.lax.Precision | None = None, dtype=None) -> jax.Array:
    """Single-token attention over each row's pages, one page per loop step, up to the longest
    row: q [B, 1, H, D], `layer`'s pages of `table` [B, W], row b sees its positions below
    lengths[b] (>= 1). Returns [B, 1, H, D]; `precision` is the matmuls', `dtype` the cache's when
    the pools hold its bits (`as_bits`).

    A step gathers one page of every row ([B, K, page_size, D], cache-sized) instead of every
    row's whole table, and the loop stops at the longest row instead of the table's width: the
    keys and values are read from memory about once. The softmax runs online across pages
    (flash-decoding), in float32.
    """
    batch, _, num_heads, dim = q.shape
    heads, page_size = k_pool.shape[2], k_pool.shape[3]
    q = q.reshape(batch, heads, num_heads // heads, dim)

    def page(i, carry):
        row_max, row_sum, out = carry  # float32 [B, K, G], [B, K, G], [B, K, G, D]
        k, v = (read_pages(pool, layer, table[:, i, None], dtype)[:, 0].astype(q.dtype)
                for pool in (k_pool, v_pool))  # [B, K, P, D]
        scores = jnp.einsum("bkgd,bkpd->bkpg", q, k, precision=precision,
                            preferred_element_type=jnp.float32) * dim**-0.5
        visible = i * page_size + jnp.arange(page_size) < lengths[:, None]  # [B, P]
        scores = jnp.where(visible[:, None, :, None], scores, -jnp.inf)
        new_max = jnp.maximum(row_max, scores.max(axis=2))
        rescale = jnp.exp(row_max - new_max)
        probs = jnp.exp(scores - new_max[:, :, None, :])
        out = out * rescale[..., None] + jnp.einsum(
            "bkpg,bkpd->bkgd", probs.astype(v.dtype), v, precision=precision,
            preferred_element_type=jnp.float32)
        return new_max, row_sum * rescale + probs.sum(axis=2), out

    group = (batch, heads, num_heads // heads)
    init = (jnp.full(group, -jnp.inf), jnp.zeros(group), jnp.zeros((*group, dim)))
    pages = (jnp.max(lengths) + page_size - 1) // page_size
    _, row_sum, out = jax.lax.fori_loop(0, pages, page, init)
    return (out / row_sum[..., None]).astype(q.dtype).reshape(batch, 1, num_heads, dim)


def decode_in_pages() -> bool:
    """Whether a decode step attends page by page (`attend_pages`): for a CPU target (module
    docstring)."""
    return target.current().platform == "cpu"


def cudnn_attend_pages(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, layer,
                       table: jax.Array, lengths: jax.Array) -> jax.Array:
    """Single-token attention by cuDNN's paged attention, reading `layer`'s pages of `table`
    [B, W] in the pools where they lie: q [B, 1, H, D] and pools of one 16-bit dtype; row b sees
    its positions below lengths[b] (>= 1). Returns [B, 1, H, D].

    Each page of a layer is a [kv_heads, page_size, head_dim] block, cuDNN's paged layout; the
    pools of all layers are one pool of layers x num_pages blocks (a reshape, no copy) and the
    layer picks its blocks by offsetting the table. `paged_attention` (JAX 0.10.2's private
    cuDNN module) insists on exactly B x W blocks in the pool, which a shared pool never has,
    so the function under it is called directly.
    """
    layers, num_pages, heads, page_size, dim = k_pool.shape
    blocks = [pool.reshape(layers * num_pages, heads, page_size, dim) for pool in (k_pool, v_pool)]
    # Entries past a row's last page may be any id; clipped, they stay inside this layer.
    table = jnp.clip(table, 0, num_pages - 1)
    pages = (layer * num_pages + table).astype(jnp.int32)[:, None, :, None]  # [B, 1, W, 1]
    unused = jnp.zeros(0, q.dtype)
    out = _cudnn_attention._dot_product_attention(
        jnp.swapaxes(q, 1, 2), *blocks, unused, jnp.ones(q.shape[:1], jnp.int32),
        lengths.astype(jnp.int32), unused, unused, pages, pages, dim**-0.5, 0, 0.0,
        (False, False), _cudnn_attention.MaskType.PADDING,
        _cudnn_attention.AttentionLayout.BNTH.value, None, _cudnn_attention.check_cudnn_version(),
        False)
    return jnp.swapaxes(out, 1, 2)


def paged_decode_kernel(q: jax.Array, pool: jax.Array):
    """The kernel a decode step of q [B, 1, H, D] over `pool` attends by, reading each row's
    pages where they lie: cuDNN's paged attention for an NVIDIA GPU target
    (`cudnn_attend_pages`), a Pallas Triton kernel for an AMD one (`pallas_attend_pages`); the
    pool in q's 16-bit dtype, and the kernel checked on that device for this layout
    (`_pages_agree`; not for a compile-only target). None: gather each row's pages."""
    where = target.current()
    if pool.dtype != q.dtype or q.dtype not in (jnp.bfloat16, jnp.float16):
        return None
    if _cudnn_supports(q):
        name = "cudnn"
    elif where.platform == "rocm":
        name = "pallas"
    else:
        return None
    if where.compile_only or _pages_agree(name, q.dtype, q.shape[2], pool.shape[2],
                                          pool.shape[3], q.shape[3]):
        return _paged_kernel(name)
    return None


def _paged_kernel(name: str):
    return {"cudnn": cudnn_attend_pages, "pallas": pallas_attend_pages}[name]


@functools.cache
def _pages_agree(name: str, dtype, heads: int, kv_heads: int, page_size: int,
                 head_dim: int) -> bool:
    """Whether the paged decode kernel `name` gives the gathered rows' attention on this
    device, for a small pool of this layout: rows of different lengths in scattered pages of a
    layer past the first, a partly visible last page. Checked once per layout at the first
    trace that would use it, because it reaches cuDNN through a private JAX function and the
    Pallas kernel has not run on a device here: if it fails or disagrees, a warning says so
    and decode steps gather the rows instead, never a wrong result."""
    rng = np.random.default_rng(0)
    layers, num_pages, width = 2, 13, 3
    pool_shape = (layers, num_pages, kv_heads, page_size, head_dim)
    # Evaluated now, also when a decode step is being traced under jit.
    with jax.ensure_compile_time_eval():
        k, v = (jnp.asarray(rng.standard_normal(pool_shape), dtype) for _ in range(2))
        q = jnp.asarray(rng.standard_normal((3, 1, heads, head_dim)), dtype)
        table = jnp.asarray(rng.permutation(num_pages)[:3 * width].reshape(3, width), jnp.int32)
        lengths = jnp.asarray([width * page_size, 1, page_size + 1], jnp.int32)
        cache = KVCache(k=k, v=v, block_table=table, lengths=lengths)
        mask = jnp.arange(width * page_size)[None, None, :] < lengths[:, None, None]
        want = np.asarray(attention(q, read_rows(cache, k, 1), read_rows(cache, v, 1), mask),
                          np.float32)
        try:
            got = np.asarray(_paged_kernel(name)(q, k, v, 1, table, lengths), np.float32)
        except Exception as e:  # noqa: BLE001 -- any failure means: do not use it
            log.warning("%s paged attention failed (%s: %s); decode steps gather each row's "
                        "pages instead", name, type(e).__name__, e)
            return False
    worst = float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-6))
    # A 16-bit dtype's rounding is ~1e-2 of unit-sized values; a wrong page or length is off by
    # the size of the values themselves.
    if worst > 0.05:
        log.warning("%s paged attention disagrees with the gathered rows (%.3g of the largest "
                    "value); decode steps gather each row's pages instead", name, worst)
        return False
    return True


@functools.partial(jax.jit, static_argnames=("config", "last_only"))
def forward_cached(params: dict, config: ModelConfig, tokens: jax.Array, cache: KVCache,
                   num_new: jax.Array | None = None, *, last_only: bool = False):
    """Appends new tokens to each row's cache and returns their logits.

    params   the model's params (layers stacked, see `params.py`)
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

    def layer_step(carry, p):
        x, k_pool, v_pool, layer = carry
        pools = {}

        def attend(q, k, v):
            if cache.interleaved:
                both = jnp.stack([k, v], axis=2).reshape(batch, -1, *k.shape[2:])  # [B, 2K, T, D]
                pools["k"], pools["v"] = write_tokens(cache, k_pool, layer, both, num_new), None
                if t == 1:
                    return ragged_attend_pages(q, pools["k"], layer, cache.block_table,
                                               cache.lengths + 1)
                rows = read_rows(cache, pools["k"], layer).astype(q.dtype)
                return attention(q, rows[:, 0::2], rows[:, 1::2], mask, precision=config.precision)
            pools["k"] = write_tokens(cache, k_pool, layer, k, num_new)
            pools["v"] = write_tokens(cache, v_pool, layer, v, num_new)
            if t == 1 and decode_in_pages():
                return attend_pages(q, pools["k"], pools["v"], layer, cache.block_table,
                                    cache.lengths + 1, config.precision, cache.kv_dtype)
            kernel = paged_decode_kernel(q, pools["k"]) if t == 1 else None
            if kernel is not None:
                return kernel(q, pools["k"], pools["v"], layer, cache.block_table,
                              cache.lengths + 1)
            # The cache may be stored in another dtype than the model computes in.
            k, v = (read_rows(cache, pools[n], layer).astype(q.dtype) for n in ("k", "v"))
            return attention(q, k, v, mask, precision=config.precision)

        x = decoder_layer(config, p, x, positions, None, attend)
        return (x, pools["k"], pools["v"], layer + 1), None

    (x, k, v, _), _ = jax.lax.scan(
        layer_step, (embed(params, tokens), cache.k, cache.v, jnp.int32(0)), params["layers"])
    hidden = final_norm(params, config, x)
    if last_only:
        hidden = hidden[jnp.arange(batch), jnp.maximum(num_new - 1, 0)]  # [B, E]
    new_cache = cache.replace(k=k, v=v, lengths=cache.lengths + num_new)
    return logits_from_hidden(params, config, hidden), new_cache


@functools.partial(jax.jit, donate_argnums=(0,))
def copy_pages(pages: tuple, src: jax.Array, dst: jax.Array) -> tuple:
    """`pages` (a pytree of page pools, e.g. `(k, v)`) with pages src[i] copied to dst[i]
    (int32 [N] each) in every layer; out-of-range dst entries are dropped (padding)."""
    return jax.tree.map(lambda pool: pool.at[:, dst].set(pool[:, src], mode="drop"), pages)
