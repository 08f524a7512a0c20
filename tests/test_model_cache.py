"""KV-cache decoding reproduces the full causal forward at every position, and the decode
program runs its layers in one loop over page pools updated in place."""
import collections
import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from devices import cuda_gpu
from helpers_hf import tiny_random_model
from rstar2_jax.model import KVCache, forward, forward_cached, init_cache, init_params
from rstar2_jax.model import cache as kv
from rstar2_jax.model.cache import (
    attend_pages,
    copy_pages,
    as_bits,
    cudnn_attend_pages,
    paged_decode_kernel,
    empty_pages,
    pool_shape,
    read_rows,
)
from rstar2_jax.model.pallas_pages import pallas_attend_pages
from rstar2_jax.model.transformer import attention
from rstar2_jax.sampler.engine import decode_chunk
from rstar2_jax.sampler.sampling import SamplingParams

TOL = 1e-4


class _Recorder:
    """Runs forward_cached and files each real token's logits under its absolute position."""

    def __init__(self, config, params, batch, max_len, seq):
        self.config, self.params = config, params
        self.cache = init_cache(config, batch, max_len)
        self.logits = np.full((batch, seq, config.vocab_size), np.nan, np.float32)

    def step(self, tokens, num_new):
        before = self.cache
        logits, self.cache = forward_cached(self.params, self.config, jnp.asarray(tokens), before,
                                            jnp.asarray(num_new, jnp.int32))
        lengths, logits = np.asarray(before.lengths), np.asarray(logits)
        kv_before = np.stack([before.k, before.v])  # [2, L, B (a page per row), K, S, D]
        kv_after = np.stack([self.cache.k, self.cache.v])
        for b, n in enumerate(num_new):
            self.logits[b, lengths[b]:lengths[b] + n] = logits[b, :n]
            if n == 0:  # an idle row's cache must be left exactly as it was
                np.testing.assert_array_equal(kv_after[:, :, b], kv_before[:, :, b])
        np.testing.assert_array_equal(self.cache.lengths, lengths + np.asarray(num_new))


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_ragged_prefill_then_decode_matches_full_forward(model_type):
    config, params = tiny_random_model(model_type)
    batch, seq = 3, 20
    seqs = np.random.default_rng(0).integers(0, config.vocab_size, (batch, seq)).astype(np.int32)
    rec = _Recorder(config, params, batch, max_len=24, seq=seq)

    def chunk(num_new, width):
        """Each row's next num_new[b] tokens, right-padded to `width` with junk."""
        start = np.asarray(rec.cache.lengths)
        out = np.full((batch, width), 7, np.int32)
        for b, n in enumerate(num_new):
            out[b, :n] = seqs[b, start[b]:start[b] + n]
        return out

    rec.step(chunk([8, 5, 0], 8), [8, 5, 0])  # prompts of different lengths; row 2 idle
    rec.step(chunk([4, 6, 6], 6), [4, 6, 6])  # a second prefill on top (a tool response)
    while (remaining := seq - np.asarray(rec.cache.lengths)).any():
        num_new = np.minimum(remaining, 1)
        rec.step(chunk(num_new, 1), num_new)  # one decode step; finished rows idle

    full = np.asarray(forward(params, config, jnp.asarray(seqs)))
    assert not np.isnan(rec.logits).any()
    assert np.abs(rec.logits - full).max() <= TOL


def test_last_only_returns_each_rows_last_real_token():
    config, params = tiny_random_model("qwen3")
    tokens = np.random.default_rng(1).integers(0, config.vocab_size, (2, 6)).astype(np.int32)
    num_new = jnp.array([6, 3], jnp.int32)
    cache = init_cache(config, 2, 8)

    all_logits, _ = forward_cached(params, config, jnp.asarray(tokens), cache, num_new)
    last, new_cache = forward_cached(params, config, jnp.asarray(tokens), cache, num_new, last_only=True)

    assert last.shape == (2, config.vocab_size)
    np.testing.assert_allclose(last[0], all_logits[0, 5], atol=1e-6)
    np.testing.assert_allclose(last[1], all_logits[1, 2], atol=1e-6)
    np.testing.assert_array_equal(new_cache.lengths, [6, 3])


def _paged(config, tables, page_size, num_pages):
    k, v = empty_pages(config, num_pages, page_size)
    return KVCache(k=k, v=v, block_table=jnp.asarray(tables, jnp.int32),
                   lengths=jnp.zeros((len(tables),), jnp.int32))


def test_rows_in_scattered_pages_match_the_full_forward():
    """Rows whose pages are spread over the pool in no order, prefilled in two ragged chunks
    and decoded, give the full causal forward's logits; other rows' pages are left alone."""
    config, params = tiny_random_model("qwen3")
    seqs = np.random.default_rng(4).integers(0, config.vocab_size, (2, 11)).astype(np.int32)
    pages = np.random.default_rng(5).permutation(9)  # page 8 belongs to no row
    cache = _paged(config, [pages[:4], pages[4:8]], page_size=3, num_pages=9)
    logits = np.zeros((2, 11, config.vocab_size), np.float32)
    for num_new in ([5, 2], [4, 7], *([[1, 1]] * 2)):
        start = np.asarray(cache.lengths)
        tokens = np.zeros((2, max(num_new)), np.int32)
        for b, n in enumerate(num_new):
            tokens[b, :n] = seqs[b, start[b]:start[b] + n]
        out, cache = forward_cached(params, config, jnp.asarray(tokens), cache,
                                    jnp.asarray(num_new, jnp.int32))
        for b, n in enumerate(num_new):
            logits[b, start[b]:start[b] + n] = np.asarray(out)[b, :n]

    full = np.asarray(forward(params, config, jnp.asarray(seqs)))
    assert np.abs(logits - full).max() <= TOL
    assert not np.asarray(cache.k[:, pages[8]]).any()


def test_rows_sharing_a_prompts_pages_continue_like_their_own_prefill():
    """One prompt prefilled once; two more rows share its full pages and copies of its partial
    last page (`copy_pages`), then each continues differently."""
    config, params = tiny_random_model("qwen2")
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, config.vocab_size, 7).astype(np.int32)
    continuations = rng.integers(0, config.vocab_size, (3, 4)).astype(np.int32)

    staged = _paged(config, [[0, 1]], page_size=4, num_pages=7)
    _, staged = forward_cached(params, config, jnp.asarray(prompt[None]), staged)
    pages = copy_pages((staged.k, staged.v), jnp.array([1, 1]), jnp.array([2, 3]))
    tables = jnp.array([[0, 1, 4], [0, 2, 5], [0, 3, 6]])  # page 0 shared, 1 copied to 2 and 3
    cache = KVCache(k=pages[0], v=pages[1], block_table=tables, lengths=jnp.full((3,), 7, jnp.int32))
    logits, _ = forward_cached(params, config, jnp.asarray(continuations), cache)

    full = forward(params, config, jnp.asarray(np.concatenate([np.tile(prompt, (3, 1)), continuations], 1)))
    assert np.abs(np.asarray(logits) - np.asarray(full[:, 7:])).max() <= TOL


@pytest.mark.parametrize("model_dtype, cache_dtype", [("float32", "bfloat16"), ("bfloat16", "float32")])
def test_cache_in_another_dtype_than_the_model(model_dtype, cache_dtype):
    config, params = tiny_random_model("qwen3", dtype=model_dtype)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, config.vocab_size, (2, 6)), jnp.int32)
    cache = init_cache(config, 2, 8, dtype=jnp.dtype(cache_dtype))

    logits, cache = forward_cached(params, config, tokens, cache)

    assert cache.k.dtype == jnp.dtype(cache_dtype) and logits.dtype == jnp.float32
    # bf16 on either side keeps ~3 significant digits; the tiny model's logits are O(1).
    np.testing.assert_allclose(logits, forward(params, config, tokens), atol=0.05)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_paged_decode_attention_matches_attention_over_the_gathered_rows(dtype):
    """`attend_pages` (one page per loop step, online softmax) against `attention` over each
    row's gathered slots: rows of different lengths in scattered pages, a row whose last page is
    only partly visible, pages past the longest row never read."""
    config, _ = tiny_random_model("qwen3", dtype=dtype, num_layers=3)
    rng = np.random.default_rng(6)
    page_size, width, num_pages = 4, 5, 17
    k, v = (jnp.asarray(rng.standard_normal((config.num_layers, num_pages, config.num_kv_heads,
                                             page_size, config.head_dim)), config.jnp_dtype)
            for _ in range(2))
    tables = jnp.asarray(rng.permutation(num_pages)[:3 * width].reshape(3, width), jnp.int32)
    lengths = jnp.asarray([13, 1, 6], jnp.int32)  # the longest row ends inside page 4 of 5
    q = jnp.asarray(rng.standard_normal((3, 1, config.num_heads, config.head_dim)),
                    config.jnp_dtype)
    cache = KVCache(k=k, v=v, block_table=tables, lengths=lengths)

    # A true float32 product on every backend (a GPU's default is TF32-like, ~1e-3).
    highest = jax.lax.Precision.HIGHEST
    out = attend_pages(q, k, v, 1, tables, lengths, highest)

    rows_k, rows_v = read_rows(cache, k, 1), read_rows(cache, v, 1)
    mask = jnp.arange(width * page_size)[None, None, :] < lengths[:, None, None]
    expected = attention(q, rows_k, rows_v, mask, precision=highest)
    tol = 1e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32),
                               atol=tol, rtol=tol)
    # Pages past the longest row are not read: NaN values there would reach the output.
    poisoned = v.at[1, tables[:, 3:]].set(jnp.nan)
    shorter = jnp.asarray([12, 1, 6], jnp.int32)
    assert np.isfinite(np.asarray(attend_pages(q, k, poisoned, 1, tables, shorter))).all()
    assert np.isnan(np.asarray(attend_pages(q, k, poisoned, 1, tables, lengths))[0]).all()


@pytest.mark.skipif(not cuda_gpu(), reason="cuDNN's paged attention needs an NVIDIA GPU")
def test_cudnn_paged_decode_matches_attention_over_the_gathered_rows():
    """Qwen3-0.6B's attention layout (16 / 8 heads, head dim 128) in bfloat16, pages of 32:
    `cudnn_attend_pages` reads the right layer's pages of each row up to its length (rows of
    different lengths in scattered pages, a partly visible last page, a pool of more pages than
    the rows use), never a page past it, and a decode step takes it on this device."""
    rng = np.random.default_rng(7)
    layers, num_pages, heads, kv_heads, page_size, dim, width = 3, 40, 16, 8, 32, 128, 5
    k, v = (jnp.asarray(rng.standard_normal((layers, num_pages, kv_heads, page_size, dim)),
                        jnp.bfloat16) for _ in range(2))
    tables = jnp.asarray(rng.permutation(num_pages)[:3 * width].reshape(3, width), jnp.int32)
    lengths = jnp.asarray([4 * page_size + 9, 1, 2 * page_size], jnp.int32)
    q = jnp.asarray(rng.standard_normal((3, 1, heads, dim)), jnp.bfloat16)
    cache = KVCache(k=k, v=v, block_table=tables, lengths=lengths)

    out = jax.jit(cudnn_attend_pages)(q, k, v, 1, tables, lengths)

    mask = jnp.arange(width * page_size)[None, None, :] < lengths[:, None, None]
    expected = attention(q, read_rows(cache, k, 1), read_rows(cache, v, 1), mask)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32),
                               atol=2e-2, rtol=2e-2)
    poisoned = v.at[1, tables[1, 1:]].set(jnp.nan).at[1, tables[2, 2:]].set(jnp.nan)
    assert np.isfinite(np.asarray(cudnn_attend_pages(q, k, poisoned, 1, tables, lengths))).all()
    assert paged_decode_kernel(q, k) is kv.cudnn_attend_pages


def test_the_pallas_paged_decode_matches_attention_over_the_gathered_rows():
    """The Pallas kernel AMD GPUs decode by (`pallas_attend_pages`), run by Pallas' interpreter
    here: Qwen3-0.6B's grouped heads (16 / 8) over the right layer's pages of each row up to its
    length (rows of different lengths in scattered pages, a partly visible last page, a pool of
    more pages than the rows use), in float32 and bfloat16."""
    rng = np.random.default_rng(7)
    layers, num_pages, heads, kv_heads, page_size, dim, width = 3, 40, 16, 8, 8, 16, 8
    lengths = jnp.asarray([4 * page_size + 3, 1, 2 * page_size], jnp.int32)
    tables = jnp.asarray(rng.permutation(num_pages)[:3 * width].reshape(3, width), jnp.int32)
    mask = jnp.arange(width * page_size)[None, None, :] < lengths[:, None, None]
    for dtype, tolerance in ((jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)):
        k, v = (jnp.asarray(rng.standard_normal((layers, num_pages, kv_heads, page_size, dim)),
                            dtype) for _ in range(2))
        q = jnp.asarray(rng.standard_normal((3, 1, heads, dim)), dtype)
        cache = KVCache(k=k, v=v, block_table=tables, lengths=lengths)

        out = pallas_attend_pages(q, k, v, 1, tables, lengths, interpret=True)

        expected = attention(q, read_rows(cache, k, 1), read_rows(cache, v, 1), mask)
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32),
                                   atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("platform, name", [("cuda", "cudnn"), ("rocm", "pallas")])
@pytest.mark.parametrize("kernel", ["right", "raises", "ignores_lengths"])
def test_a_paged_decode_kernel_that_fails_or_disagrees_is_never_used(kernel, platform, name,
                                                                      monkeypatch, caplog):
    """The check before a paged decode kernel (cuDNN's for NVIDIA, the Pallas one for AMD; run
    here with stand-ins for the kernel): one that raises, or that reads every slot of each
    row's pages instead of stopping at its length, is not used and a warning says so; one that
    agrees with the gathered rows is."""
    def stand_in(q, k, v, layer, table, lengths):
        if kernel == "raises":
            raise RuntimeError("no such kernel")
        cache = KVCache(k=k, v=v, block_table=table, lengths=lengths)
        slots = jnp.arange(table.shape[1] * k.shape[3])[None, None, :]
        mask = slots < (slots.size if kernel == "ignores_lengths" else lengths[:, None, None])
        return attention(q, read_rows(cache, k, layer), read_rows(cache, v, layer), mask)

    kv._pages_agree.cache_clear()
    monkeypatch.setattr(kv.target, "current", lambda: kv.target.Target(platform, 9.0))
    monkeypatch.setattr(kv, f"{name}_attend_pages", stand_in)
    q = jnp.zeros((2, 1, 4, 16), jnp.bfloat16)
    pool = jnp.zeros((1, 5, 2, 8, 16), jnp.bfloat16)
    try:
        with caplog.at_level("WARNING", logger="rstar2_jax.model.cache"):
            used = kv.paged_decode_kernel(q, pool)
    finally:
        kv._pages_agree.cache_clear()
    assert used is (stand_in if kernel == "right" else None)
    assert ("decode steps gather each row's pages instead" in caplog.text) == (kernel != "right")


def _decode_program(num_layers, num_pages=40, page_size=8, slots=4, dtype="float32"):
    """The compiled decode call of the engine for a tiny Qwen3 of `num_layers` layers serving
    in `dtype`, its pools as the engine keeps them (abstract inputs: nothing is allocated)."""
    config, _ = tiny_random_model("qwen3", num_layers=num_layers)
    config = dataclasses.replace(config, dtype=dtype)
    params = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    pages = jax.eval_shape(
        lambda: tuple(as_bits(pool) for pool in empty_pages(config, num_pages, page_size)))
    shape = jax.ShapeDtypeStruct
    rows = shape((slots,), jnp.int32)
    return decode_chunk.lower(
        params, pages, shape((slots, 4), jnp.int32), rows, rows, shape((slots,), bool), rows,
        shape((slots, 2), jnp.uint32), shape((1,), jnp.int32), shape((), jnp.int32),
        config=config, sampling=SamplingParams(temperature=1.0, top_p=0.9), chunk=8,
        forward_fn=forward_cached).compile()


def _opcodes(compiled) -> collections.Counter:
    """How often each HLO opcode appears in a compiled program."""
    return collections.Counter(re.findall(r"^\s*(?:ROOT )?%\S+ = .*?\s([a-z][a-z0-9-]*)\(",
                                          compiled.as_text(), flags=re.M))


def test_the_decode_program_is_the_same_at_any_depth():
    """The layers run under one loop: 28 layers compile the same instructions as 4 (only the
    stacked arrays' leading axis differs), so compile time does not grow with depth."""
    shallow, deep = _opcodes(_decode_program(4)), _opcodes(_decode_program(28))
    assert shallow == deep
    assert shallow["while"] >= 2  # the decode steps, and the layers inside them


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_decode_program_updates_the_page_pools_in_place(dtype):
    """The donated pools are the outputs' buffers and no temporary holds a copy of one (in
    bfloat16 too, which XLA:CPU would scatter through a float32 copy of the whole pool)."""
    compiled = _decode_program(4, num_pages=400, dtype=dtype)
    pool_bytes = jnp.dtype(dtype).itemsize * math.prod(pool_shape(tiny_random_model("qwen3", num_layers=4)[0], 400, 8))
    memory = compiled.memory_analysis()
    assert memory.alias_size_in_bytes >= 2 * pool_bytes
    assert memory.temp_size_in_bytes < pool_bytes
