"""A decode step's attention over the paged KV cache by a Pallas (Triton) kernel, reading each
row's pages where they lie in the pool: what AMD GPUs (ROCm) run, where cuDNN's paged attention
does not exist and gathering each row's block table copies its keys and values (and the pages
past its length, up to the table's power-of-two width) before attending over them.

The kernel is JAX's `jax.experimental.pallas.ops.gpu.paged_attention` kernel (flash-decoding:
each program attends one row's kv head over a share of its pages, online softmax, stopping at
the row's length; the shares are combined after). Only its pallas_call is ours, for the pools'
layout: all layers' pages are one pool of [kv_heads, page_size, head_dim] blocks (a reshape),
the kernel reads kv head h of each block through a strided view, and the layer picks its blocks
by offsetting the table, as for cuDNN (`cache.cudnn_attend_pages`).

Block sizes: `_PAGES_PER_BLOCK` pages of keys per loop step and `_STAGES` software-pipeline
stages fit the MI300X's 64 KiB of shared memory per block with pages of 32 x 128 bfloat16
(4 pages in 2 stages do not); at few rows each row's pages are split in shares that run as
programs of their own, about `_PROGRAMS` programs in all (the MI300X has 304 compute units).
Not timed on a device yet.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.experimental.pallas.ops.gpu.paged_attention import (
    DEFAULT_MASK_VALUE,
    paged_attention_kernel,
)

_PAGES_PER_BLOCK = 2
_STAGES = 2
_PROGRAMS = 1024
# Query heads per program: Triton's matmuls take at least 16 rows.
_BLOCK_H = 16
_WARPS = 4


def pallas_attend_pages(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, layer,
                        table: jax.Array, lengths: jax.Array, *, interpret: bool = False
                        ) -> jax.Array:
    """Single-token attention over `layer`'s pages `table` [B, W] of pools [layers, num_pages,
    kv_heads, page_size, head_dim]: q [B, 1, H, D] in the pools' dtype; row b sees its
    positions below lengths[b] (>= 1). Returns [B, 1, H, D]. `interpret` runs the kernel in
    Pallas' interpreter (any backend: the tests' CPU)."""
    layers, num_pages, kv_heads, page_size, dim = k_pool.shape
    batch, _, heads, _ = q.shape
    group = heads // kv_heads
    width = table.shape[1]
    per_block = min(_PAGES_PER_BLOCK, width)
    # Shares of each row's pages: enough programs to fill the GPU at few rows, few at many
    # (each share writes a partial output); a power of two, which divides the table's width.
    splits = min(_PROGRAMS // (batch * kv_heads), width // per_block)
    splits = 1 << max(splits, 1).bit_length() - 1
    blocks = [pool.reshape(layers * num_pages, kv_heads, page_size, dim) for pool in (k_pool, v_pool)]
    # Entries past a row's last page may be any id; clipped, they stay inside this layer.
    table = (layer * num_pages + jnp.clip(table, 0, num_pages - 1)).astype(jnp.int32)
    padded = -(-group // _BLOCK_H) * _BLOCK_H
    # The kernel takes the scores as they come: the queries carry the softmax's scale.
    scaled = (q.astype(jnp.float32) * dim**-0.5).astype(q.dtype).reshape(batch, kv_heads, group, dim)
    q = jnp.pad(scaled, ((0, 0), (0, 0), (0, padded - group), (0, 0)))
    kernel = functools.partial(paged_attention_kernel, num_heads=group,
                               pages_per_compute_block=per_block, mask_value=DEFAULT_MASK_VALUE,
                               attn_logits_soft_cap=None)
    pool_spec = pl.BlockSpec((layers * num_pages, None, page_size, dim), lambda h, i, s: (0, h, 0, 0))
    share = (None, None, _BLOCK_H)

    def one_row(q, table, length):  # q [K, G', D], table [W], length []
        o, l, m = pl.pallas_call(
            kernel,
            grid=(kv_heads, padded // _BLOCK_H, splits),
            in_specs=[pl.BlockSpec((None, _BLOCK_H, dim), lambda h, i, s: (h, i, 0)),
                      pool_spec, None, pool_spec, None,
                      pl.BlockSpec((None, width // splits), lambda h, i, s: (s, 0)),
                      pl.BlockSpec((1,), lambda h, i, s: (0,))],
            out_specs=[pl.BlockSpec((*share, dim), lambda h, i, s: (s, h, i, 0)),
                       pl.BlockSpec(share, lambda h, i, s: (s, h, i)),
                       pl.BlockSpec(share, lambda h, i, s: (s, h, i))],
            out_shape=[jax.ShapeDtypeStruct((splits, *q.shape), q.dtype),
                       jax.ShapeDtypeStruct((splits, *q.shape[:-1]), jnp.float32),
                       jax.ShapeDtypeStruct((splits, *q.shape[:-1]), jnp.float32)],
            compiler_params=plgpu.CompilerParams(num_warps=_WARPS, num_stages=_STAGES),
            interpret=interpret, name="paged_decode_attention",
        )(q, blocks[0], None, blocks[1], None, table.reshape(splits, width // splits), length[None])
        # The shares' softmax sums and maxima [S, K, G] combine them (flash-decoding); the
        # padding heads are dropped first, so that the combination reads only the real ones.
        o, l, m = o[:, :, :group], l[:, :, :group], m[:, :, :group]
        top = m.max(axis=0)
        scale = jnp.exp(m - top)
        total = (l * scale).sum(axis=0)
        out = (o.astype(jnp.float32) * scale[..., None]).sum(axis=0)
        return out / (total[..., None] + jnp.finfo(jnp.float32).eps)

    out = jax.vmap(one_row)(q, table, lengths.astype(jnp.int32))  # [B, K, G, D] float32
    return out.reshape(batch, 1, heads, dim).astype(scaled.dtype)
