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

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_kernel as splash_kernel,
    splash_attention_mask_info as splash_mask_info,
)
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention
from jax.sharding import PartitionSpec as P

from rstar2_jax.model.axes import FSDP, TP
from rstar2_jax.model.packed_attention import Segments

# Tokens per splash block: rows are padded to a multiple of `_SPLASH_LANE` (the kernel's
# least block) and cut into the largest of these that divides them (MaxText's default is 512).
_SPLASH_BLOCKS = (512, 256, 128)
_SPLASH_LANE = 128
# Keys a ragged paged attention block reads at once (its pages of one row, `_RAGGED_KV_TOKENS`
# / page size of them), and query tokens (rows, in a decode step) per block: JAX's tuned table
# for TPU v6e and pages of 32 tokens gives 8 pages for rows of 256 tokens and 32 queries (it
# stops at rows of 512). The kernel copies in whole blocks (a row's last one padded with its
# first page), so a row reads up to a block more than it holds: at 2,049 tokens, 72 pages for
# 65 (1.11x), where blocks of 16 pages would read 80 (1.23x).
_RAGGED_KV_TOKENS = 256
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


def _first_key_blocks(ids: jax.Array, bounds: jax.Array, block: int) -> jax.Array:
    """int32 [B, n]: the first key block each query block of rows of n blocks needs, the block
    holding the start of its first query's segment (`ids` [B, n * block], its segments' start
    `bounds` [B, M + 2]): segments are contiguous, so it needs the key blocks from there up to
    itself and no other (`packed_attention.packed_block_plan`)."""
    return jnp.take_along_axis(bounds, ids[:, ::block], axis=1) // block


def _mask_infos(first: jax.Array, block: int) -> tuple:
    """Splash attention's mask information for one row from `first` int32 [n] (see
    `_first_key_blocks`), for the forward, dq and dkv kernels: the blocks a query block needs
    are computed (the diagonal one under a causal mask, the others whole; the segment ids mask
    within them), the others skipped, and the block each skipped step points at is the next
    one computed, so that no block is copied in for nothing. (JAX 0.10.2 builds this form from
    a dense [T, T] mask per row, `splash_attention_mask_info._process_dynamic_mask`.)"""
    n = first.shape[0]
    i, j = jnp.arange(n)[:, None], jnp.arange(n)[None, :]
    needed = (j >= first[:, None]) & (j <= i)
    # 1: computed under the causal block below; 2: computed whole; 0: skipped.
    kind = jnp.where(needed, jnp.where(j == i, 1, 2), 0)[None].astype(jnp.int8)
    index = jnp.int16 if n > 127 else jnp.int8
    after = jnp.concatenate([first[1:], first[:1]])[:, None]  # the next row's first block
    kv_next = jnp.where(j < first[:, None], first[:, None], jnp.where(j > i, after, j))
    q_next = jnp.where(i < j, j, jnp.where(needed, i, j))
    causal = jnp.tril(jnp.ones((block, block), bool))[None]
    zeros = jnp.zeros_like(kind)

    def info(data_next, partial):
        return splash_mask_info.MaskInfo(data_next[None].astype(index), zeros, kind, partial,
                                         None, True)

    forward = info(kv_next, causal)
    return forward, forward, info(q_next, jnp.swapaxes(causal, 1, 2))


def _splash_rows(q, k, v, ids, first):
    """Splash attention of rows q [B, H, T, D], k/v [B, K, T, D] (T a multiple of
    `_SPLASH_LANE`), each token seeing the tokens of its own segment id [B, T] up to itself,
    computing only the blocks `first` [B, n] says each query block needs."""
    block = q.shape[2] // first.shape[1]
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                              block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                              block_q_dq=block, block_kv_dq=block)

    def row(q, k, v, ids, first):
        kernel = splash_kernel.SplashAttentionKernel(
            *_mask_infos(first, block), block_sizes=sizes, is_mqa=False, save_residuals=False,
            mask_value=splash_kernel.DEFAULT_MASK_VALUE, attn_logits_soft_cap=None,
            residual_checkpoint_name=None, mask_function=None, interpret=False)
        return kernel(q, k, v, splash.SegmentIds(ids, ids))

    return jax.vmap(row)(q, k, v, ids, first)


def splash_packed_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                            segments: Segments) -> jax.Array:
    """Causal attention over packed rows by splash attention: q [B, T, H, D], k/v [B, K, T, D]
    (K divides H) -> [B, T, H, D] in q's dtype; each token sees the tokens of its own segment
    (`Segments`) up to itself, the padding tail included, as `_packed_attention` does.

    Rows are padded to a multiple of `_SPLASH_LANE` tokens with a segment of their own (id -1)
    and cut after, and cut into blocks of `_splash_block` tokens. Like `_packed_attention`, it
    computes only the key blocks each query block needs (from the one holding the start of its
    first query's segment up to its own; `_mask_infos`), the segment ids masking within them.
    Scores and softmax are float32; the scale is applied to q in float32 before it is cast
    back (the kernel takes no scale).
    """
    b, t, h, d = q.shape
    pad = -t % _SPLASH_LANE
    q = (q.astype(jnp.float32) * d**-0.5).astype(q.dtype)
    q = jnp.pad(jnp.swapaxes(q, 1, 2), [(0, 0), (0, 0), (0, pad), (0, 0)])  # [B, H, T', D]
    k, v = (jnp.pad(x, [(0, 0), (0, 0), (0, pad), (0, 0)]) for x in (k, v))
    ids = jnp.pad(segments.ids, [(0, 0), (0, pad)], constant_values=-1)
    # The padding is under a block: every block's first query is a real token.
    first = _first_key_blocks(ids, segments.bounds, _splash_block(t + pad))
    mesh, rows, heads = _mesh_axes(b, (h, k.shape[1]))
    if mesh is None:
        out = _splash_rows(q, k, v, ids, first)
    else:
        spec = P(rows, heads, None, None)
        out = jax.shard_map(_splash_rows, mesh=mesh,
                            in_specs=(spec, spec, spec, P(rows, None), P(rows, None)),
                            out_specs=spec, check_vma=False)(q, k, v, ids, first)
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


def splash_flops(segment_lengths, t: int, heads: int, head_dim: int, kernel: str) -> int:
    """Matmul FLOPs of `splash_packed_attention`'s `kernel` ("fwd", "dq" or "dkv") over packed
    rows of t tokens (`segment_lengths` [B, M], as `packed_segments` takes them) and `heads`
    query heads (XLA's cost analysis counts nothing inside a custom call): the block pairs it
    computes (`_mask_infos`) times the kernel's matmuls per pair (2, 3, 4) of 2 x block^2 x
    head_dim each. Counted on the host (a compile-only target's device cannot run JAX)."""
    block = _splash_block(t + -t % _SPLASH_LANE)
    ends = np.minimum(np.cumsum(np.asarray(segment_lengths), axis=1), t)
    starts = np.concatenate([np.zeros((len(ends), 1), ends.dtype), ends], axis=1)
    firsts = np.arange(0, t, block)  # each block's first query: a real token
    # The segment holding a query starts at the last segment start at or before it.
    segment_start = np.stack([row[np.searchsorted(row, firsts, side="right") - 1]
                              for row in starts])
    pairs = int(np.sum(np.arange(len(firsts)) - segment_start // block + 1))
    matmuls = {"fwd": 2, "dq": 3, "dkv": 4}[kernel]
    return pairs * heads * matmuls * 2 * block * block * head_dim
