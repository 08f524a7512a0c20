"""Plain generation against transformers, the model's own log-probs, and compile counts."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from helpers_hf import make_tiny_hf_checkpoint
from rstar2_jax.model import load_hf, token_logprobs
from rstar2_jax.model.cache import copy_pages
from rstar2_jax.sampler import engine as engine_lib
from rstar2_jax.sampler import generate

PROMPTS = [[5, 17, 99, 3, 42, 8, 11], [7, 1], [100, 64, 2, 9, 33], [12, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def checkpoint(request, tmp_path_factory):
    path = make_tiny_hf_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=3)
    config, params = load_hf(path)
    return path, config, params


def hf_greedy(path, prompts, max_new_tokens):
    """transformers greedy generate on a left-padded batch; returns the new tokens per prompt."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    width = max(len(p) for p in prompts)
    ids = np.zeros((len(prompts), width), np.int64)
    mask = np.zeros((len(prompts), width), np.int64)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = p
        mask[i, width - len(p):] = 1
    with torch.no_grad():
        out = model.generate(torch.as_tensor(ids), attention_mask=torch.as_tensor(mask),
                             max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                             eos_token_id=None)
    return out[:, width:].numpy().tolist()


def test_greedy_matches_transformers_generate(checkpoint):
    path, config, params = checkpoint
    new = 24
    ours = generate(params, config, PROMPTS, new, temperature=0.0)
    theirs = hf_greedy(path, PROMPTS, new)
    for g, want in zip(ours, theirs):
        assert g.finish_reason == "length"
        assert g.tokens == want


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_continuous_batching_gives_the_same_tokens(checkpoint, temperature):
    _, config, params = checkpoint
    full = generate(params, config, PROMPTS, 12, temperature=temperature, seed=4)
    refilled = generate(params, config, PROMPTS, 12, temperature=temperature, seed=4,
                        num_slots=2, chunk=5)
    assert [g.tokens for g in refilled] == [g.tokens for g in full]
    if temperature:
        other_seed = generate(params, config, PROMPTS, 12, temperature=temperature, seed=5)
        assert [g.tokens for g in other_seed] != [g.tokens for g in full]


def test_sampler_logprobs_match_the_forward(checkpoint):
    _, config, params = checkpoint
    for temperature in (1.0, 0.7):
        gens = generate(params, config, PROMPTS, 16, temperature=temperature, seed=1)
        for prompt, g in zip(PROMPTS, gens):
            seq = np.asarray(prompt + g.tokens, np.int32)[None]
            logp = token_logprobs(params, config, seq[:, :-1], seq[:, 1:],
                                  temperature=temperature)
            np.testing.assert_allclose(np.asarray(logp)[0, len(prompt) - 1:], g.logprobs,
                                       atol=1e-4)


def test_each_prompt_can_have_its_own_budget(checkpoint):
    _, config, params = checkpoint
    full = generate(params, config, PROMPTS, 9, temperature=1.0, seed=2)
    budgets = [9, 1, 4, 6]
    each = generate(params, config, PROMPTS, budgets, temperature=1.0, seed=2, num_slots=2)
    assert [g.tokens for g in each] == [f.tokens[:n] for f, n in zip(full, budgets)]
    assert {g.finish_reason for g in each} == {"length"}
    with pytest.raises(ValueError, match="one per prompt"):
        generate(params, config, PROMPTS, [9, 1], temperature=1.0)


def test_stop_tokens_end_rows_independently(checkpoint):
    _, config, params = checkpoint
    free = generate(params, config, PROMPTS, 20)
    # Stop each row at the 4th token it produced without a stop list.
    stops = {g.tokens[3] for g in free}
    stopped = generate(params, config, PROMPTS, 20, stop_tokens=sorted(stops))
    for f, s in zip(free, stopped):
        cut = next(i for i, t in enumerate(f.tokens) if t in stops)
        assert s.tokens == f.tokens[: cut + 1]
        assert s.finish_reason == "stop"


def test_no_recompilation_inside_warm_buckets(checkpoint):
    _, config, params = checkpoint
    fns = [engine_lib.decode_chunk, engine_lib.prefill, copy_pages]
    rng = np.random.default_rng(0)

    def batch(lengths):
        return [rng.integers(1, config.vocab_size, size=n).tolist() for n in lengths]

    # Warm the buckets: longest prompt <= 8 or <= 16 tokens; prefill widths 8 and 16.
    for lengths in ([3, 5, 9, 2], [16, 5, 7, 2], [4, 4, 4, 4]):
        generate(params, config, batch(lengths), 6, num_slots=4)
    sizes = [f._cache_size() for f in fns]
    for lengths in ([2, 9, 16, 11], [6, 1, 13, 15], [5, 6, 7, 8], [12, 3, 10, 9]):
        generate(params, config, batch(lengths), 6, num_slots=4)
    assert [f._cache_size() for f in fns] == sizes


def test_the_block_table_follows_the_longest_row(checkpoint, monkeypatch):
    """The table a decode step reads widens past its first bucket as rows lengthen and narrows
    once they finish and short rows take their slots; tokens are those of transformers
    throughout."""
    path, config, params = checkpoint
    widths = []

    def recording_decode(params, pages, block_table, *args, **kwargs):
        widths.append(block_table.shape[1] * pages[0][0].shape[2])
        return decode(params, pages, block_table, *args, **kwargs)

    decode = engine_lib.decode_chunk
    monkeypatch.setattr(engine_lib, "decode_chunk", recording_decode)
    new = 150  # prompt + 150 tokens crosses the 128-position bucket
    ours = generate(params, config, PROMPTS, new, num_slots=2, chunk=16)

    assert [g.tokens for g in ours] == hf_greedy(path, PROMPTS, new)
    grown = next(i for i, width in enumerate(widths) if width > 128)
    assert 128 in widths[grown:]  # narrowed when the next prompts replaced the long rows


def test_rows_hold_the_pages_their_tokens_fill(checkpoint):
    """A row holds pages for its tokens and its next decode call, not for max_len; a released
    row's pages and a prompt's staged pages go back to the pool."""
    _, config, params = checkpoint
    engine = engine_lib.Engine(params, config, num_slots=2, max_len=512, max_prompt_len=16,
                               sampling=engine_lib.SamplingParams(), stop_tokens=(-1,), chunk=32,
                               page_size=16)
    assert engine.num_pages == 2 * 32 + engine_lib.STAGE_ROWS
    keys = engine_lib.sequence_keys(0, 2)
    (staged,) = engine.stage_prompts([PROMPTS[3]])  # 10 tokens staged: one partial page
    engine.admit([(staged, 0, 100, keys[0]), (staged, 1, 40, keys[1])])
    engine.unstage(staged)
    while engine.decode().count.any():
        assert len(engine.tables[0]) == engine.pages_for(len(engine.history[0]))
    # 11 + 100 tokens, the last one pending: no page past them.
    assert [len(engine.history[s]) for s in (0, 1)] == [110, 50]
    assert len(engine.tables[0]) == 7 and len(engine.tables[1]) == 4
    assert engine.num_pages - len(engine.free) == 11
    engine.release([0, 1])
    assert len(engine.free) == engine.num_pages


def test_the_default_pool_holds_each_row_at_full_length_and_no_more(checkpoint, monkeypatch):
    """Without num_pages every row runs to its budget unpreempted, in a pool of at most one
    full-length row plus one page per slot (no pages for staged prompts beside the rows, no
    rows rounded up to a power of two: those made generate() run out of memory on a GPU at 64
    rows of 2,176 tokens)."""
    _, config, params = checkpoint
    engines, preempted = [], []
    init, evict = engine_lib.Engine.__init__, engine_lib.Engine._evict

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        engines.append(self)

    monkeypatch.setattr(engine_lib.Engine, "__init__", recording_init)
    monkeypatch.setattr(engine_lib.Engine, "_evict", lambda self, slot: (preempted.append(slot), evict(self, slot)))
    # Rows of 16 + 34 tokens: 7 pages of 8 (a power-of-two row would take 8).
    new = 34
    out = generate(params, config, PROMPTS, new, page_size=8)
    assert [len(g.tokens) for g in out] == [new] * len(PROMPTS)
    assert not preempted
    (engine,) = engines
    assert engine.pages_per_row == 7
    assert engine.num_pages <= engine.num_slots * (engine.pages_per_row + 1)
    assert [g.tokens for g in out] == [g.tokens for g in generate(params, config, PROMPTS, new, page_size=8,
                                                                    num_pages=1024)]


def test_a_small_pool_preempts_and_resumes_rows_with_the_same_tokens(checkpoint, monkeypatch):
    """With pages for little more than one full row, rows are preempted (their pages taken back)
    and later recomputed from their tokens; every row still gets transformers' tokens."""
    path, config, params = checkpoint
    preempted = []
    evict = engine_lib.Engine._evict

    def recording_evict(self, slot):
        preempted.append(slot)
        evict(self, slot)

    monkeypatch.setattr(engine_lib.Engine, "_evict", recording_evict)
    new = 120
    # One row of 16 + 120 tokens is 9 pages of 16; 4 staged prompts hold 4 more.
    ours = generate(params, config, PROMPTS, new, num_slots=4, chunk=8, page_size=16,
                    num_pages=9 + 4 + 3)

    assert preempted
    assert [g.tokens for g in ours] == hf_greedy(path, PROMPTS, new)
