"""The Pallas TPU kernels the model uses on TPUs, run on CPU in Pallas' interpret mode against the
XLA paths they replace: splash attention over packed rows against the block-skipping kernel
(values and q/k/v gradients), ragged paged attention of a decode step against the gathered
rows."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from helpers_hf import tiny_random_model
from pallas_interpret import ragged_interpret, splash_interpret
from rstar2_jax.model import (KVCache, forward, forward_cached, packed_attention, target,
                              token_logprobs, tpu_attention)
from rstar2_jax.model import cache as cache_lib
from rstar2_jax.model.cache import pool_shape, read_rows
from rstar2_jax.parallel.sharding import make_mesh
from rstar2_jax.sampler import engine as engine_lib
from rstar2_jax.sampler import generate
from rstar2_jax.model.transformer import attention

HIGHEST = jax.lax.Precision.HIGHEST

# Packed rows of T tokens ([rows, slots] sequence lengths, T), in 3 blocks of 128 (T is no
# multiple of 128: the kernel's rows are padded): several sequences per row with a 1-token one
# and a padding tail, sequences spanning blocks, sequences starting at a block's start (the
# blocks before it skipped); a sequence filling its row beside one of T - 1 tokens and a
# 1-token one.
SEVERAL = (np.array([[60, 1, 90, 30], [120, 70, 0, 0], [128, 128, 1, 40]], np.int32), 330)
FILLING = (np.array([[330, 0], [329, 1]], np.int32), 330)


def _packed(layout, dtype, heads=4, kv_heads=2, dim=32):
    lengths, t = layout
    segments = packed_attention.packed_segments(jnp.asarray(lengths), t)
    keys = jax.random.split(jax.random.key(int(lengths.sum())), 4)
    b = lengths.shape[0]
    q = jax.random.normal(keys[0], (b, t, heads, dim), jnp.float32)
    k, v = (jax.random.normal(key, (b, kv_heads, t, dim), jnp.float32) for key in keys[1:3])
    weights = jax.random.normal(keys[3], q.shape, jnp.float32)  # every output weighs differently
    return (q, k, v), segments, weights


def _value_and_grads(attend, qkv, weights, dtype):
    def loss(q, k, v):
        out = attend(q.astype(dtype), k.astype(dtype), v.astype(dtype))
        return jnp.sum(out.astype(jnp.float32) * weights), out
    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(*qkv)
    return [np.asarray(x, np.float32) for x in (out, *grads)]


def _splash_and_block(layout, dtype):
    qkv, segments, weights = _packed(layout, dtype)

    def splash(q, k, v):
        return tpu_attention.splash_packed_attention(q, k, v, segments)

    def block(q, k, v):
        return packed_attention._packed_attention(q, k, v, segments.ids, segments.bounds,
                                                  packed_attention._BLOCK, 1, HIGHEST)

    with splash_interpret():
        got = _value_and_grads(splash, qkv, weights, dtype)
    return got, _value_and_grads(block, qkv, weights, dtype), qkv, weights, block


def test_the_layouts_hold_several_sequences_per_row_and_the_edge_cases():
    lengths, t = SEVERAL
    assert ((lengths > 0).sum(axis=1) >= 2).all()  # every row holds several sequences
    assert (lengths == 1).any()  # a 1-token sequence
    lengths, t = FILLING
    assert (lengths.sum(axis=1) == t).all() and (lengths == t).any()  # one fills its row


@pytest.mark.parametrize("layout", [SEVERAL, FILLING], ids=["several", "filling"])
def test_splash_equals_the_block_kernel_in_float32(layout):
    """Output and q/k/v gradients of a weighted sum, float32: the same up to float32 rounding."""
    got, want, *_ = _splash_and_block(layout, jnp.float32)
    for name, g, w in zip(["out", "d_q", "d_k", "d_v"], got, want):
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=2e-5, err_msg=name)


@pytest.mark.parametrize("layout", [SEVERAL, FILLING], ids=["several", "filling"])
def test_splash_is_as_close_to_float32_as_the_block_kernel_in_bfloat16(layout):
    """In bfloat16 both kernels round; splash's output and gradients are as close to the
    float32 result as the block kernel's own (within twice its largest error), where attending
    across a segment or past the diagonal would be off by the values themselves."""
    got, want, qkv, weights, block = _splash_and_block(layout, jnp.bfloat16)
    exact = _value_and_grads(block, qkv, weights, jnp.float32)
    for name, g, w, e in zip(["out", "d_q", "d_k", "d_v"], got, want, exact):
        rounding = np.max(np.abs(w - e))
        assert 0 < rounding < 0.05 * np.max(np.abs(e)), name
        assert np.max(np.abs(g - e)) <= 2 * rounding, name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ragged_paged_attention_reads_the_pages_in_place_like_the_gathered_rows(dtype):
    """A decode step's attention over an interleaved pool (keys and values of all layers in one
    array, the kernel's layout) by ragged paged attention, against `attention` over each row's
    gathered slots: grouped-query heads (4 / 2), head dim 128, pages of the sampler's 32
    tokens, rows of different lengths in scattered pages of a layer past the first (a full
    row, a 1-token row, one ending inside a page), a pool of more pages than the rows use. The
    kernel's pool holds NaN in every page of that layer that no row holds, and its table entries
    past each row's last page name pages that do not exist."""
    rng = np.random.default_rng(3)
    layers, num_pages, heads, kv_heads, page_size, dim, width = 3, 24, 4, 2, 32, 128, 4
    dtype = jnp.dtype(dtype)
    pool = jnp.asarray(rng.standard_normal((layers, num_pages, page_size, 2 * kv_heads, dim)),
                       dtype)
    tables = jnp.asarray(rng.permutation(num_pages)[:3 * width].reshape(3, width), jnp.int32)
    lengths = jnp.asarray([width * page_size, 1, page_size + 5], jnp.int32)
    q = jnp.asarray(rng.standard_normal((3, 1, heads, dim)), dtype)
    used = np.zeros(num_pages, bool)
    for row, n in enumerate(np.asarray(lengths)):
        used[np.asarray(tables[row, :-(-n // page_size)])] = True
    poisoned = pool.at[1, np.flatnonzero(~used)].set(jnp.nan)
    # Table entries past each row's last page name no page at all: the interpreter raises on
    # a read out of bounds.
    past = np.arange(width)[None, :] >= -(-np.asarray(lengths)[:, None] // page_size)
    nowhere = jnp.where(past, 10**6, tables)
    cache = KVCache(k=pool, v=None, block_table=tables, lengths=lengths)

    with ragged_interpret():
        out = jax.jit(tpu_attention.ragged_attend_pages)(q, poisoned, 1, nowhere, lengths)

    rows = read_rows(cache, pool, 1)  # [B, 2K, slots, D], keys and values interleaved
    visible = jnp.arange(width * page_size)[None, None, :] < lengths[:, None, None]
    expected = attention(q, rows[:, 0::2], rows[:, 1::2], visible, precision=HIGHEST)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    tol = 1e-5 if dtype == jnp.float32 else 2e-2  # bfloat16: ~3 significant digits
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32),
                               atol=tol, rtol=tol)


def test_rows_of_an_interleaved_pool_decoded_by_the_kernel_match_the_full_forward():
    """A tiny Qwen3 with head dim 128 over one interleaved pool (its rows' pages scattered, a
    page no row holds): prompts of 7 and 3 tokens prefilled in one call (the gathered path),
    then decoded a token at a time by ragged paged attention, each step gives the full causal
    forward's logits at its position; the page no row holds stays empty."""
    config, params = tiny_random_model("qwen3", head_dim=128)
    seqs = np.random.default_rng(4).integers(0, config.vocab_size, (2, 11)).astype(np.int32)
    pages = np.random.default_rng(5).permutation(9)  # page 8 belongs to no row
    pool = jnp.zeros(pool_shape(config, 9, 3, interleaved=True), jnp.float32)
    cache = KVCache(k=pool, v=None, block_table=jnp.asarray([pages[:4], pages[4:8]], jnp.int32),
                    lengths=jnp.zeros((2,), jnp.int32))
    steps = []
    with ragged_interpret():
        _, cache = forward_cached(params, config, jnp.asarray(seqs[:, :7]), cache,
                                  jnp.asarray([7, 3], jnp.int32))
        for _ in range(4):
            at = np.asarray(cache.lengths)
            out, cache = forward_cached(params, config, jnp.asarray(seqs[[0, 1], at][:, None]), cache)
            steps.append((at, np.asarray(out)[:, 0]))

    full = np.asarray(forward(params, config, jnp.asarray(seqs)))
    for at, out in steps:
        np.testing.assert_allclose(out, full[[0, 1], at], atol=1e-4)
    assert [at.tolist() for at, _ in steps] == [[7, 3], [8, 4], [9, 5], [10, 6]]
    assert cache.interleaved and not np.asarray(cache.k[:, pages[8]]).any()


@pytest.mark.slow
def test_a_tpu_sampler_preempting_and_refilling_rows_decodes_like_the_cpu_one(monkeypatch):
    """`generate` with a TPU's kernels (interleaved pools, decode steps by ragged paged
    attention, interpreted) against the CPU's (two pools, page by page): 4 prompts in 2 slots
    (rows refilled as others finish), a pool so small that rows are preempted and prefilled
    again; the same greedy tokens and log-probs."""
    config, params = tiny_random_model("qwen3", head_dim=128)
    prompts = [[5, 17, 9, 3, 42, 8, 11], [7, 1], [10, 64, 2, 9, 33], [12, 13, 14, 15, 16, 17]]
    preempted = []
    evict = engine_lib.Engine._evict
    monkeypatch.setattr(engine_lib.Engine, "_evict",
                        lambda self, row: (preempted.append(row), evict(self, row)))
    # Rows of 8 + 40 tokens: 6 pages of 8; two staged prompts hold 2 more.
    run = functools.partial(generate, params, config, prompts, 40, temperature=0.0, num_slots=2,
                            chunk=8, page_size=8, num_pages=6 + 2 + 1)
    on_cpu = run()
    assert preempted
    pools = []
    monkeypatch.setattr(target, "current", lambda: target.Target("tpu"))
    empty = cache_lib.empty_pages
    monkeypatch.setattr(engine_lib, "empty_pages", lambda *a: pools.append(empty(*a)) or pools[-1])
    preempted.clear()
    with ragged_interpret():
        on_tpu = run()
    assert preempted and [p.shape for p in pools[0]] == [pool_shape(config, 9, 8, True)]
    assert [g.tokens for g in on_tpu] == [g.tokens for g in on_cpu]
    for got, want in zip(on_tpu, on_cpu):
        np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-4)


def _kernels(fn, *args) -> set[str]:
    """The Pallas TPU kernels a trace of fn(*args) calls."""
    text = str(jax.make_jaxpr(fn)(*args))
    return {name for name in ("splash_mha_fwd", "splash_mha_dq", "splash_mha_dkv",
                              "ragged_paged_attention_kernel") if name in text}


@pytest.mark.parametrize("platform", ["tpu", "cpu"])
def test_the_tpu_kernels_are_chosen_for_a_tpu_target_only(platform, monkeypatch):
    """For a TPU target, a bfloat16 training pass over packed rows runs splash attention
    forward and backward (float32 keeps the block kernel: the kernel does not take the
    policy's matmul precision) and a sampler's pools of a model the ragged kernel takes are
    interleaved and decoded by it; a model it does not take (head dim 8) keeps two pools. For
    a CPU target, none of them."""
    monkeypatch.setattr(target, "current", lambda: target.Target(platform, compile_only=True))
    jax.clear_caches()  # jit's traces are keyed by the target's device, which this stand-in keeps
    tpu = platform == "tpu"
    tokens = jnp.zeros((2, 40), jnp.int32)
    lengths = jnp.asarray([[20, 1, 10], [40, 0, 0]], jnp.int32)
    for dtype in ("bfloat16", "float32"):
        config, params = tiny_random_model("qwen3", dtype=dtype)

        def loss(params):
            return token_logprobs(params, config, tokens, tokens, segment_lengths=lengths).sum()
        want = {"splash_mha_fwd", "splash_mha_dq", "splash_mha_dkv"} if tpu and dtype == "bfloat16" else set()
        assert _kernels(jax.grad(loss), params) == want, dtype

    for head_dim, takes in ((128, tpu), (8, False)):
        config, params = tiny_random_model("qwen3", dtype="bfloat16", head_dim=head_dim)
        pools = cache_lib.empty_pages(config, 6, 8)
        assert len(pools) == (1 if takes else 2)
        cache = KVCache.of_pools(pools, jnp.zeros((2, 3), jnp.int32), jnp.ones((2,), jnp.int32))
        step = functools.partial(forward_cached, config=config)
        assert _kernels(lambda p, c: step(p, tokens=tokens[:, :1], cache=c), params, cache) == (
            {"ragged_paged_attention_kernel"} if takes else set())


def test_on_a_mesh_each_device_attends_over_its_rows_and_heads():
    """Traced for a (fsdp 2, tp 2) mesh (`target.compiling_for_mesh`), both kernels run under
    `shard_map` (XLA does not partition them), rows over fsdp and heads over tp, and give what
    they give on one device."""
    mesh = make_mesh(2, 2)
    lengths = jnp.asarray([[60, 1, 90, 30], [120, 70, 0, 0], [200, 0, 0, 0], [50] * 4], jnp.int32)
    segments = packed_attention.packed_segments(lengths, 200)
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (4, 200, 4, 32))
    k, v = (jax.random.normal(key, (4, 2, 200, 32)) for key in keys[1:])
    splash = jax.jit(lambda q, k, v, ids, bounds: tpu_attention.splash_packed_attention(
        q, k, v, packed_attention.Segments(ids, None, bounds)))

    rng = np.random.default_rng(0)
    pool = jnp.asarray(rng.standard_normal((2, 20, 32, 4, 128)), jnp.float32)
    tables = jnp.asarray(rng.permutation(20)[:16].reshape(4, 4), jnp.int32)
    decode_q = jnp.asarray(rng.standard_normal((4, 1, 4, 128)), jnp.float32)
    context = jnp.asarray([128, 1, 40, 70], jnp.int32)
    ragged = jax.jit(tpu_attention.ragged_attend_pages)

    def place(x, *spec):
        return jax.device_put(x, NamedSharding(mesh, P(*spec)))

    with splash_interpret():
        want = splash(q, k, v, segments.ids, segments.bounds)
        with target.compiling_for_mesh(mesh):
            args = (place(q, "fsdp", None, "tp"), place(k, "fsdp", "tp"), place(v, "fsdp", "tp"),
                    segments.ids, segments.bounds)
            assert "manual_computation" in splash.lower(*args).as_text()
            np.testing.assert_allclose(splash(*args), want, atol=1e-6)
    with ragged_interpret():
        want = ragged(decode_q, pool, 1, tables, context)
        with target.compiling_for_mesh(mesh):
            args = (place(decode_q, "fsdp", None, "tp"), pool, 1, place(tables, "fsdp"),
                    place(context, "fsdp"))
            assert "manual_computation" in ragged.lower(*args).as_text()
            np.testing.assert_allclose(ragged(*args), want, atol=1e-6)


def test_the_hand_counts_of_the_kernels_work():
    """What XLA's cost analysis cannot see inside the custom calls: ragged paged attention
    copies whole blocks of 8 pages of 32 (a row of 2,049 tokens: 65 pages in 9 blocks, 72
    pages; a 1-token row: one block of 8; blocks no wider than the table) of 2 x 8 heads x 128 x 2
    bytes; splash attention computes the block pairs its mask information names, 2, 3 and 4
    matmuls each (forward, dq, dkv)."""
    page = 32 * 2 * 8 * 128 * 2
    assert tpu_attention.ragged_bytes([2049, 1], 32, 128, 8, 128, 2) == (72 + 8) * page
    assert tpu_attention.ragged_bytes([100], 32, 4, 8, 128, 2) == 4 * page  # a 4-page table
    # SEVERAL's rows compute 5, 5 and 3 block pairs (test_splash_computes_only_the_blocks...).
    pair = 2 * 128 * 128 * 32
    assert tpu_attention.splash_flops(SEVERAL[0], 330, 4, 32, "fwd") == 13 * 4 * 2 * pair
    assert tpu_attention.splash_flops(SEVERAL[0], 330, 4, 32, "dkv") == 13 * 4 * 4 * pair
    # One sequence filling a row of 2,047 tokens (padded to 2,048): 4 x 5 / 2 pairs of 512.
    assert tpu_attention.splash_flops([[2047]], 2047, 1, 64, "dq") == 10 * 3 * 2 * 512**2 * 64


def test_splash_computes_only_the_blocks_each_query_block_needs():
    """The mask information of SEVERAL's rows (3 blocks of 128): a query block computes the key
    blocks from the one holding the start of its first query's segment up to its own (the
    diagonal one under the causal mask: 1, the others whole: 2), and skips the rest (0), so no
    block joining only other segments is computed."""
    lengths, t = SEVERAL
    segments = packed_attention.packed_segments(jnp.asarray(lengths), t)
    ids = jnp.pad(segments.ids, [(0, 0), (0, 384 - t)], constant_values=-1)
    first = tpu_attention._first_key_blocks(ids, segments.bounds, 128)
    # Row 0: block 1 starts inside [61, 151), block 2 inside the tail [181, 330).
    # Row 1: block 1 inside [120, 190), block 2 inside the tail [190, 330).
    # Row 2: blocks 1 and 2 start sequences of their own.
    np.testing.assert_array_equal(first, [[0, 0, 1], [0, 0, 1], [0, 1, 2]])
    kinds = [np.asarray(tpu_attention._mask_infos(row, 128)[0].block_mask[0]) for row in first]
    np.testing.assert_array_equal(kinds[0], [[1, 0, 0], [2, 1, 0], [0, 2, 1]])
    np.testing.assert_array_equal(kinds[2], np.eye(3))
    forward, dq, dkv = tpu_attention._mask_infos(first[0], 128)
    # The blocks a step copies in: the computed one, or for a skipped step the next computed.
    np.testing.assert_array_equal(forward.data_next[0], [[0, 0, 0], [0, 1, 1], [1, 1, 2]])
    np.testing.assert_array_equal(dkv.data_next[0], [[0, 1, 2], [1, 1, 2], [0, 2, 2]])
