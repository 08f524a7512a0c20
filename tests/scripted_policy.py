"""A scripted policy for sampler tests: emits fixed assistant turns, whatever the tool says.

It has the cached-forward signature of the model. Its "KV cache" stores the token ids themselves
(in the pages the engine gives each row),
so it can read a row's whole history: the turn index is the number of `<|im_start|>` tokens
after the prompt's three (system, user, assistant), two per tool response; the offset is the
number of tokens since the last `<|im_start|>assistant\\n<reason>`. Script `i` is chosen by the
prompt's first token, the id of the digit `i` (see `prompts_for`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from rstar2_jax import chat
from rstar2_jax.model import ModelConfig
from rstar2_jax.model.cache import read_rows, write_tokens

FORMAT = chat.ChatFormat(system_prompt="Use the tool.", user_template="{question}")


def make_policy(tokenizer, scripts):
    """Returns (config, params, forward_fn, marker ids) for `scripts`, lists of turn texts."""
    im_end = tokenizer.convert_tokens_to_ids(chat.IM_END)
    im_start = tokenizer.convert_tokens_to_ids(chat.IM_START)
    tail = len(tokenizer.encode("assistant\n" + chat.REASON_START, add_special_tokens=False))
    turns = [[tokenizer.encode(t, add_special_tokens=False) + [im_end] for t in s] for s in scripts]
    max_turns = max(len(t) for t in turns)
    width = max(len(x) for t in turns for x in t)
    table = np.full((len(scripts), max_turns, width), im_end, np.int32)
    for i, script in enumerate(turns):
        for j, ids in enumerate(script):
            table[i, j, : len(ids)] = ids
    vocab = len(tokenizer)
    markers = [tokenizer.encode(str(i), add_special_tokens=False)[0] for i in range(len(scripts))]
    index = np.zeros((vocab,), np.int32)
    index[markers] = np.arange(len(scripts))
    params = {"script": jnp.asarray(table), "index": jnp.asarray(index)}
    config = ModelConfig(model_type="qwen3", vocab_size=vocab, hidden_size=2,
                         intermediate_size=2, num_layers=1, num_heads=1, num_kv_heads=1,
                         head_dim=2)

    def forward(params, config, tokens, cache, num_new=None, *, last_only=False):
        assert last_only
        batch, t = tokens.shape
        size = cache.max_len
        num_new = jnp.full((batch,), t, jnp.int32) if num_new is None else num_new
        # The token history lives in layer 0's keys, at kv head 0, dim 0.
        new = jnp.broadcast_to(tokens[:, None, :, None], (batch, 1, t, 2))
        k = write_tokens(cache, cache.k, 0, new, num_new)
        n = cache.lengths + num_new
        hist = read_rows(cache, k, 0)[:, 0, :, 0].astype(jnp.int32)  # [B, S]
        starts = (hist == im_start) & (jnp.arange(size)[None] < n[:, None])
        last_start = jnp.max(jnp.where(starts, jnp.arange(size)[None], -1), axis=1)
        turn = (starts.sum(1) - 3) // 2  # system, user, assistant; +2 per tool response
        offset = n - (last_start + 1 + tail)
        script = params["index"][hist[:, 0]]
        nxt = params["script"][script, jnp.clip(turn, 0, max_turns - 1),
                               jnp.clip(offset, 0, width - 1)]
        logits = jax.nn.one_hot(nxt, vocab) * 30.0
        return logits, cache.replace(k=k, lengths=n)

    return config, params, forward, markers


def prompts_for(tokenizer, markers, script_ids):
    """Prompts that select the given scripts."""
    return [[markers[i]] + chat.encode_prompt(tokenizer, f"problem {i}", FORMAT)
            for i in script_ids]
