"""Plain generation against transformers, the model's own log-probs, and compile counts."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from helpers_hf import make_tiny_hf_checkpoint
from rstar2_jax.model import load_hf, token_logprobs
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
    fns = [engine_lib.decode_chunk, engine_lib.prefill_stage, engine_lib.admit]
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


def test_cache_follows_the_longest_row(checkpoint, monkeypatch):
    """The cache grows past its first bucket as rows lengthen and shrinks once they finish and
    short rows take their slots; tokens are those of transformers throughout."""
    path, config, params = checkpoint
    sizes = []

    def recording_resize(cache, max_len):
        sizes.append(max_len)
        return resize(cache, max_len)

    resize = engine_lib.resize_cache
    monkeypatch.setattr(engine_lib, "resize_cache", recording_resize)
    new = 150  # prompt + 150 tokens crosses the 128-slot bucket
    ours = generate(params, config, PROMPTS, new, num_slots=2, chunk=16)

    assert [g.tokens for g in ours] == hf_greedy(path, PROMPTS, new)
    grown = next(i for i, size in enumerate(sizes) if size > 128)
    assert 128 in sizes[grown:]  # shrank back when the next prompts replaced the long rows


@pytest.mark.parametrize("release", [True, False])
def test_released_rows_stop_holding_the_cache(checkpoint, release):
    """A long row that finished keeps the cache long until it is released."""
    _, config, params = checkpoint
    engine = engine_lib.Engine(params, config, num_slots=2, max_len=512, max_prompt_len=16,
                               sampling=engine_lib.SamplingParams(), stop_tokens=(-1,), chunk=32)
    keys = engine_lib.sequence_keys(0, 2)
    engine.stage_prompts([0, 1], [PROMPTS[0], PROMPTS[1]])
    engine.admit([(0, 0, PROMPTS[0][-1], 150, keys[0])])
    while engine.decode().count[0]:
        pass
    assert engine.state.cache.max_len == 256
    if release:
        engine.release([0])
    engine.admit([(1, 1, PROMPTS[1][-1], 20, keys[1])])
    engine.decode()
    assert engine.state.cache.max_len == (128 if release else 256)
