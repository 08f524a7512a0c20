"""Causal attention over packed rows that computes only the blocks of scores it needs.

A packed row lays several sequences end to end (`Segments`, built by `packed_segments`), each
attending only to itself, causally, with positions from 0. Scored whole under a segment mask, a
row of T tokens costs T x T scores whatever its sequences' lengths, most of them masked away.
Segments are contiguous, so which key blocks a query block needs (those of its own segments, up
to the causal diagonal) is known from the segment bounds before any score is computed:
`packed_block_plan` counts them, `_schedule` orders the work, and `_packed_attention` computes
only those blocks, forward and backward, with a hand-written backward pass that recomputes the
probabilities rather than storing them. Its loops are lax loops, whose body XLA's cost analysis
counts once: `packed_block_visits` gives the block pairs it really computes.

`transformer.attention` decides where this kernel runs (and where cuDNN's packed kernel, or
whole rows under a segment mask, run instead; docs/accelerators.md). `transformer` imports this
module, not the reverse, so the packed-row layout and the head-grouping helpers that the model's
other attention paths share with the kernel are defined here.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

# A finite "minus infinity": a query with no visible key (a left pad) then gets a uniform
# softmax instead of NaN, so its garbage never poisons gradients through masked sums.
_MASKED = float(jnp.finfo(jnp.float32).min)
# The forward's output and softmax statistics, which its backward reads: a checkpoint policy
# that saves this name keeps them instead of running the forward again.
KEPT_NAME = "packed_attention_forward"


class Segments(NamedTuple):
    """Packed rows: consecutive segments, each a sequence that attends only to itself
    (causally) and whose positions start at 0. The tokens after a row's last segment form one
    more segment (its padding), so every token belongs to one. Built by `packed_segments`.

    ids       int32 [B, T]      segment of each token, 0, 1, ... from the row's start
    positions int32 [B, T]      token index within its segment
    bounds    int32 [B, M + 2]  segment m is tokens [bounds[m], bounds[m + 1]); the last one
                                 is the tail (bounds[M + 1] = T)
    """

    ids: jax.Array
    positions: jax.Array
    bounds: jax.Array


def packed_segments(segment_lengths: jax.Array, t: int) -> Segments:
    """`Segments` of rows of t tokens from `segment_lengths` int32 [B, M]: the lengths of the
    sequences laid end to end from each row's start (0 for an unused slot); lengths running
    past t are cut at t (a train step's inputs drop each row's last token)."""
    batch = segment_lengths.shape[0]
    ends = jnp.minimum(jnp.cumsum(segment_lengths.astype(jnp.int32), axis=1), t)  # [B, M]
    bounds = jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), ends,
                              jnp.full((batch, 1), t, jnp.int32)], axis=1)
    index = jnp.arange(t, dtype=jnp.int32)
    ids = jnp.sum(index[None, :, None] >= ends[:, None, :], axis=-1, dtype=jnp.int32)
    positions = index[None] - jnp.take_along_axis(bounds, ids, axis=1)
    return Segments(ids, positions, bounds)


def _grouped(x, kv_heads):
    """Per-query-head x [B, T, H, D] -> [B, K, G, T, D]: query head h reads kv head h // G."""
    b, t, h, d = x.shape
    return x.reshape(b, t, kv_heads, h // kv_heads, d).transpose(0, 2, 3, 1, 4)


def _ungrouped(x):
    """[B, K, G, T, D] -> [B, T, H, D]."""
    b, kv_heads, group, t, d = x.shape
    return x.transpose(0, 3, 1, 2, 4).reshape(b, t, kv_heads * group, d)


# Key/query blocks of `_packed_attention` and the (row, block) items it works on at once on
# accelerators (`transformer.attention` picks the group).
_BLOCK = 128
_GROUP = 8


def packed_block_plan(segments: Segments, t: int, block: int = _BLOCK
                      ) -> tuple[jax.Array, jax.Array]:
    """How many key blocks each query block of packed rows of t tokens needs, and how many
    query blocks each key block is needed by: int32 [B, n] each, n = ceil(t / block).

    Segments are contiguous, so query block c needs the key blocks from the one holding the
    start of its first query's segment up to c (its later queries' segments start no earlier),
    and key block r is needed by the query blocks c >= r whose range reaches back to r, a run
    that ends where the ranges start after r."""
    n = -(-t // block)
    firsts = jnp.arange(n, dtype=jnp.int32) * block
    seg = segments.ids[:, firsts]  # [B, n]: segment of each block's first query
    lo = jnp.take_along_axis(segments.bounds, seg, axis=1) // block  # first key block needed
    blocks = jnp.arange(n, dtype=jnp.int32)
    per_query = blocks - lo + 1
    per_key = jnp.sum(lo[:, None, :] <= blocks[None, :, None], axis=-1, dtype=jnp.int32) - blocks
    return per_query, per_key


def _schedule(counts: jax.Array, group: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Items (row, block) flattened from counts [B, n] and ordered by count, longest first, in
    groups of `group` items (the last padded with items of count 0): the items int32 [g, group],
    their counts [g, group] (a group loops as long as its first, masking the others' ends) and
    each item's place in that order [B * n]."""
    flat = counts.reshape(-1)
    order = jnp.argsort(-flat, stable=True).astype(jnp.int32)
    pad = -flat.size % group
    items = jnp.pad(order, (0, pad)).reshape(-1, group)
    ordered = jnp.pad(flat[order], (0, pad)).reshape(-1, group)
    return items, ordered, jnp.argsort(order).astype(jnp.int32)


def packed_block_visits(segment_lengths, t: int, block: int = _BLOCK, group: int = _GROUP
                        ) -> tuple[int, int]:
    """(query, key) block pairs `_packed_attention` computes on packed rows of t tokens
    (forward, backward), the masked ends of its groups included: its honest work, which XLA's
    cost analysis (a loop's body counted once) does not give."""
    per_query, per_key = packed_block_plan(packed_segments(jnp.asarray(segment_lengths), t), t,
                                           block)
    return tuple(int(jnp.sum(_schedule(c, group)[1][:, 0]) * group) for c in (per_query, per_key))


def _blocks(x, axis, block, fill):
    """x with its token axis (size T) cut into n blocks, the block index moved to the front
    with the rows: [B, ..., T, ...] -> [B * n, ..., block, ...], padded at the end with fill."""
    pad = -x.shape[axis] % block
    x = jnp.pad(x, [(0, pad) if a == axis else (0, 0) for a in range(x.ndim)],
                constant_values=fill)
    x = x.reshape(*x.shape[:axis], -1, block, *x.shape[axis + 1:])
    x = jnp.moveaxis(x, axis, 1)
    return x.reshape(-1, *x.shape[2:])


def _block_mask(q_ids, k_ids, q_block, k_block, block):
    """[g, C, C] bool: which keys of blocks k_block [g] each query of blocks q_block [g] sees
    (same segment, not after it); q_ids/k_ids [g, C] the blocks' segment ids."""
    offsets = jnp.arange(block, dtype=jnp.int32)
    q_pos = q_block[:, None] * block + offsets
    k_pos = k_block[:, None] * block + offsets
    return (q_ids[:, :, None] == k_ids[:, None, :]) & (q_pos[:, :, None] >= k_pos[:, None, :])


def _packed_blocks(q, k, v, ids, block):
    """The block views both passes of `_packed_attention` read: grouped queries [B * n, K, G,
    C, D], keys and values [B * n, K, C, D], and the queries' and keys' segment ids [B * n, C]
    (tokens past T: -1 on the query side, -2 on the key side, so no pad query sees a key)."""
    qb = _blocks(_grouped(q, k.shape[1]), 3, block, 0)
    kb, vb = (_blocks(x, 2, block, 0) for x in (k, v))
    return qb, kb, vb, _blocks(ids, 1, block, -1), _blocks(ids, 1, block, -2)


def _packed_fwd(q, k, v, ids, bounds, block, group, precision):
    b, t, h, d = q.shape
    kv_heads = k.shape[1]
    n = -(-t // block)
    per_query, per_key = packed_block_plan(Segments(ids, None, bounds), t, block)
    items, counts, place = _schedule(per_query, group)
    qb, kb, vb, q_ids, k_ids = _packed_blocks(q, k, v, ids, block)
    scale = d**-0.5

    def one_group(_, a):
        item, count = a
        qi, qid = qb[item], q_ids[item]

        def step(j, carry):
            out, row_max, row_sum = carry
            key = jnp.maximum(item - j, 0)
            scores = jnp.einsum("ikgqd,iksd->ikgqs", qi, kb[key], precision=precision,
                                preferred_element_type=jnp.float32) * scale
            mask = (_block_mask(qid, k_ids[key], item % n, key % n, block)
                    & (j < count)[:, None, None])[:, None, None]
            scores = jnp.where(mask, scores, _MASKED)
            new_max = jnp.maximum(row_max, jnp.max(scores, axis=-1, keepdims=True))
            unnormalized = jnp.where(mask, jnp.exp(scores - new_max), 0.0)
            kept = row_sum * jnp.exp(row_max - new_max)
            new_sum = kept + jnp.sum(unnormalized, axis=-1, keepdims=True)
            # The output stays normalised by the sum so far: with one key block this is
            # `_block_fwd`'s arithmetic, so both paths round alike.
            divisor = jnp.where(new_sum > 0, new_sum, 1.0)  # a pad query past t sees no key
            out = out * (kept / divisor) + jnp.einsum(
                "ikgqs,iksd->ikgqd", (unnormalized / divisor).astype(v.dtype), vb[key],
                precision=precision, preferred_element_type=jnp.float32)
            return out, new_max, new_sum

        shape = qi.shape[:-1] + (1,)
        init = (jnp.zeros(qi.shape, jnp.float32), jnp.full(shape, _MASKED, jnp.float32),
                jnp.zeros(shape, jnp.float32))
        out, row_max, row_sum = jax.lax.fori_loop(0, count[0], step, init)
        return None, (out, row_max, jnp.where(row_sum > 0, row_sum, 1.0))

    _, res = jax.lax.scan(one_group, None, (items, counts))
    # Named so that a layer's checkpoint policy can keep them for the backward (`KEPT_NAME`).
    out, row_max, row_sum = (checkpoint_name(x.reshape(-1, *x.shape[2:])[place], KEPT_NAME)
                             for x in res)  # [B * n, ...]
    merged = out.reshape(b, n, *out.shape[1:])
    merged = jnp.moveaxis(merged, 1, 3).reshape(b, kv_heads, h // kv_heads, n * block, d)
    return (_ungrouped(merged[:, :, :, :t].astype(v.dtype)),
            (q, k, v, ids, per_key, out, row_max, row_sum))


def _packed_bwd(block, group, precision, res, d_out):
    q, k, v, ids, per_key, out, row_max, row_sum = res
    b, t, h, d = q.shape
    kv_heads = k.shape[1]
    n = -(-t // block)
    items, counts, place = _schedule(per_key, group)
    qb, kb, vb, q_ids, k_ids = _packed_blocks(q, k, v, ids, block)
    d_out_b = _blocks(_grouped(d_out, kv_heads), 3, block, 0)
    # sum_s probs * d_probs = sum_d out * d_out: the softmax backward needs no pass over keys.
    row_dot = jnp.sum(out * d_out_b.astype(jnp.float32), axis=-1, keepdims=True)
    scale = d**-0.5

    def one_group(d_q, a):
        item, count = a
        ki, vi, kid = kb[item], vb[item], k_ids[item]

        def step(j, carry):
            d_q, d_k, d_v = carry
            query = jnp.minimum(item + j, b * n - 1)
            valid = j < count
            qi, d_o = qb[query], d_out_b[query]
            scores = jnp.einsum("ikgqd,iksd->ikgqs", qi, ki, precision=precision,
                                preferred_element_type=jnp.float32) * scale
            mask = (_block_mask(q_ids[query], kid, query % n, item % n, block)
                    & valid[:, None, None])[:, None, None]
            probs = jnp.where(mask, jnp.exp(scores - row_max[query]) / row_sum[query], 0.0)
            d_v = d_v + jnp.einsum("ikgqs,ikgqd->iksd", probs.astype(v.dtype), d_o,
                                   precision=precision, preferred_element_type=jnp.float32)
            d_probs = jnp.einsum("ikgqd,iksd->ikgqs", d_o, vi, precision=precision,
                                 preferred_element_type=jnp.float32)
            d_scores = (probs * (d_probs - row_dot[query]) * scale).astype(q.dtype)
            d_k = d_k + jnp.einsum("ikgqs,ikgqd->iksd", d_scores, qi, precision=precision,
                                   preferred_element_type=jnp.float32)
            d_qi = jnp.einsum("ikgqs,iksd->ikgqd", d_scores, ki, precision=precision,
                              preferred_element_type=jnp.float32)
            # Within a step the group's valid items add to distinct query blocks; the others
            # point past the end and are dropped.
            d_q = d_q.at[jnp.where(valid, query, b * n)].add(d_qi, mode="drop")
            return d_q, d_k, d_v

        zeros = jnp.zeros(ki.shape, jnp.float32)
        d_q, d_k, d_v = jax.lax.fori_loop(0, count[0], step, (d_q, zeros, zeros))
        return d_q, (d_k, d_v)

    d_q, (d_k, d_v) = jax.lax.scan(one_group, jnp.zeros(qb.shape, jnp.float32), (items, counts))
    d_k, d_v = (x.reshape(-1, *x.shape[2:])[place] for x in (d_k, d_v))  # [B * n, K, C, D]
    d_k, d_v = (jnp.moveaxis(x.reshape(b, n, *x.shape[1:]), 1, 2)
                .reshape(b, kv_heads, n * block, d)[:, :, :t] for x in (d_k, d_v))
    d_q = jnp.moveaxis(d_q.reshape(b, n, *d_q.shape[1:]), 1, 3)
    d_q = d_q.reshape(b, kv_heads, h // kv_heads, n * block, d)[:, :, :, :t]
    return (_ungrouped(d_q).astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype), None,
            None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _packed_attention(q, k, v, ids, bounds, block, group, precision):
    """Causal attention over packed rows (q [B, T, H, D], k/v [B, K, T, D]; `Segments`' ids
    [B, T] and bounds) that computes only the key blocks each query block needs
    (`packed_block_plan`), FlashAttention-2 style: per query block an online softmax over its
    key blocks; the backward pass, per key block over the query blocks that need it (the
    forward pass keeps that half of the plan), recomputes the probabilities from the kept row
    max and sum. Blocks are `block` tokens; `group` (row, block) items run together, ordered by
    their number of blocks so that a group's items loop about as long as each other. Loops are
    lax loops: the program does not grow with T."""
    return _packed_fwd(q, k, v, ids, bounds, block, group, precision)[0]


_packed_attention.defvjp(_packed_fwd, _packed_bwd)
