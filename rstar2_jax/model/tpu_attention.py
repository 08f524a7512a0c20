"""Attention by the Pallas TPU kernels that ship with JAX: splash attention over packed rows
(training) and ragged paged attention over the paged KV cache (decode).

Both are `pallas_call`s compiled by Mosaic into one TPU custom call each; `transformer.attention`
and `cache.forward_cached` choose them for a TPU target (docs/accelerators.md says when). On CPU
they run only in Pallas' interpret mode (`jax.experimental.pallas.tpu.force_tpu_interpret_mode`),
which is how the tests check them against the XLA paths.

A Pallas custom call is not partitioned by XLA: on a mesh of several devices (the abstract mesh
of `jax.sharding.use_mesh`, which the trainer and the sampler enter while they trace) each
kernel runs under `jax.shard_map`, rows over `fsdp` and heads over `tp` where the mesh divides
them, so every device attends over its own rows and heads instead of all of them.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention
from jax.sharding import PartitionSpec as P

from rstar2_jax.model.axes import FSDP, TP
from rstar2_jax.model.packed_attention import Segments

# Tokens per splash block: rows are padded to a multiple of `_SPLASH_LANE` (the kernel's
# least block) and cut into the largest of these that divides them (MaxText's default is 512).
_SPLASH_BLOCKS = (512, 256, 128)
_SPLASH_LANE = 128
# Keys a ragged paged attention block reads at once (its pages of one row, `_RAGGED_KV_TOKENS`
# / page size of them), and query tokens (rows, in a decode step) per block: the sizes JAX's
# tuned table gives TPU v6e for pages of 32 tokens and rows up to 512 or more tokens.
_RAGGED_KV_TOKENS = 512
_RAGGED_QUERIES = 32


def _mesh_axes(batch: int, heads: tuple[int, ...]) -> tuple[object, str | None, str | None]:
    """The abstract mesh the program is traced under (None for one device or no mesh) and the
    axes that split the rows (`fsdp`) and the heads (`tp`), each None where the mesh has no
    such axis or does not divide `batch` / every count in `heads`."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return None, None, None
    shape = dict(mesh.shape)
    rows = FSDP if shape.get(FSDP, 1) > 1 and batch % shape[FSDP] == 0 else None
    split = TP if shape.get(TP, 1) > 1 and all(n % shape[TP] == 0 for n in heads) else None
    return mesh, rows, split


def _splash_block(t: int) -> int:
    return next(b for b in _SPLASH_BLOCKS if t % b == 0)


@functools.cache
def _splash_kernel(heads: int, t: int):
    """Splash attention for rows of t tokens (a multiple of `_SPLASH_LANE`) and `heads` query
    heads: causal, forward and backward blocks of `_splash_block(t)` tokens."""
    block = _splash_block(t)
    mask = splash.MultiHeadMask([splash.CausalMask((t, t))] * heads)
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                              block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                              block_q_dq=block, block_kv_dq=block)
    return splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1)


def _splash_rows(q, k, v, ids):
    """Splash attention of rows q [B, H, T, D], k/v [B, K, T, D] (T a multiple of
    `_SPLASH_LANE`), each token seeing the tokens of its own segment id [B, T] up to itself."""
    kernel = _splash_kernel(q.shape[1], q.shape[2])
    return jax.vmap(lambda q, k, v, ids: kernel(q, k, v, splash.SegmentIds(ids, ids)))(
        q, k, v, ids)


def splash_packed_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                            segments: Segments) -> jax.Array:
    """Causal attention over packed rows by splash attention: q [B, T, H, D], k/v [B, K, T, D]
    (K divides H) -> [B, T, H, D] in q's dtype; each token sees the tokens of its own segment
    (`Segments`) up to itself, the padding tail included, as `_packed_attention` does.

    Rows are padded to a multiple of `_SPLASH_LANE` tokens with a segment of their own (id -1)
    and cut after. The kernel's mask is causal and static; the segment ids mask within the
    blocks it visits, so it computes the causal half of each row (T^2 / 2 scores), where the
    XLA kernel computes only the blocks each segment reaches. Scores and softmax are float32;
    the scale is applied to q in float32 before it is cast back (the kernel takes no scale).
    """
    b, t, h, d = q.shape
    pad = -t % _SPLASH_LANE
    q = (q.astype(jnp.float32) * d**-0.5).astype(q.dtype)
    q = jnp.pad(jnp.swapaxes(q, 1, 2), [(0, 0), (0, 0), (0, pad), (0, 0)])  # [B, H, T', D]
    k, v = (jnp.pad(x, [(0, 0), (0, 0), (0, pad), (0, 0)]) for x in (k, v))
    ids = jnp.pad(segments.ids, [(0, 0), (0, pad)], constant_values=-1)
    mesh, rows, heads = _mesh_axes(b, (h, k.shape[1]))
    if mesh is None:
        out = _splash_rows(q, k, v, ids)
    else:
        spec = P(rows, heads, None, None)
        out = jax.shard_map(_splash_rows, mesh=mesh, in_specs=(spec, spec, spec, P(rows, None)),
                            out_specs=spec, check_vma=False)(q, k, v, ids)
    return jnp.swapaxes(out[:, :, :t], 1, 2)


def ragged_kernel_supports(num_heads: int, num_kv_heads: int, head_dim: int, dtype) -> bool:
    """Whether ragged paged attention (JAX 0.10.2) takes this layout: head dim a multiple of
    128 (its accumulators are 128 lanes wide), keys and values interleaved on a head axis the
    TPU tiles whole (2 x kv heads a power of two up to 8 or a multiple of 8, in 32-bit words),
    kv heads dividing the query heads, and a cache of bfloat16 or float32."""
    dtype = jnp.dtype(dtype)
    if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        return False
    if head_dim % 128 or num_heads % num_kv_heads:
        return False
    words, rest = divmod(2 * num_kv_heads, 4 // dtype.itemsize)
    return not rest and (words in (1, 2, 4, 8) or words % 8 == 0)


def ragged_attend_pages(q: jax.Array, pool: jax.Array, layer, table: jax.Array,
                        lengths: jax.Array) -> jax.Array:
    """Single-token attention by ragged paged attention, reading `layer`'s pages of `table`
    [B, W] where they lie in `pool` [layers, num_pages, page_size, 2 K, D] (keys and values
    interleaved on the head axis: key head i at 2i, value head i at 2i + 1, the kernel's
    layout): q [B, 1, H, D]; row b sees its positions below lengths[b] (>= 1), and the kernel
    reads only its pages up to there (in blocks of `_RAGGED_KV_TOKENS`; the unused places of a
    row's last block are filled with its first page). Returns [B, 1, H, D] in q's dtype.

    The pools of all layers are one array of layers x num_pages pages (a reshape, no copy); the
    layer picks its pages by offsetting the table. Block sizes are given, as JAX's tuned table
    would otherwise look up the process's default device (the CPU when compiling for a TPU).
    """
    layers, num_pages, page_size, combined, dim = pool.shape
    batch, width = table.shape
    pages = pool.reshape(layers * num_pages, page_size, combined, dim)
    # Entries past a row's last page may be any id: the kernel never reads them.
    table = (layer * num_pages + table).astype(jnp.int32)
    per_block = min(width, max(1, _RAGGED_KV_TOKENS // page_size))
    queries = min(batch, _RAGGED_QUERIES)

    def attend(q, pages, table, lengths):
        rows = q.shape[0]
        return ragged_paged_attention(
            q, pages, lengths.astype(jnp.int32), table, jnp.arange(rows + 1, dtype=jnp.int32),
            jnp.array([rows], jnp.int32), sm_scale=dim**-0.5, num_kv_pages_per_block=per_block,
            num_queries_per_block=min(rows, queries))

    mesh, rows, heads = _mesh_axes(batch, (q.shape[2], combined // 2))
    if heads is not None and not ragged_kernel_supports(
            q.shape[2] // mesh.shape[heads], combined // 2 // mesh.shape[heads], dim, pool.dtype):
        heads = None  # a device's share of the heads would not tile: each reads all of them
    if mesh is None:
        out = attend(q[:, 0], pages, table, lengths)
    else:
        # Each device reads its rows' pages of its heads; the pool's rows are not split.
        out = jax.shard_map(attend, mesh=mesh, in_specs=(
            P(rows, heads, None), P(None, None, heads, None), P(rows, None), P(rows)),
            out_specs=P(rows, heads, None), check_vma=False)(q[:, 0], pages, table, lengths)
    return out[:, None]


def ragged_bytes(lengths, page_size: int, width: int, kv_heads: int, head_dim: int,
                 itemsize: int) -> int:
    """Bytes of keys and values one layer's `ragged_attend_pages` reads for rows of `lengths`
    (after the step's write) with block tables `width` pages wide: each row's pages in whole
    blocks (the kernel's DMAs; XLA's cost analysis counts nothing inside a custom call)."""
    per_block = min(width, max(1, _RAGGED_KV_TOKENS // page_size))
    page = page_size * 2 * kv_heads * head_dim * itemsize
    return sum(math.ceil(math.ceil(n / page_size) / per_block) * per_block * page
               for n in lengths)
