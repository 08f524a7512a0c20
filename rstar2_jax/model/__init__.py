"""Qwen2 / Qwen3 dense decoders as pure functions of a params pytree, and their HF checkpoints.

    config, params = load_hf("path/to/checkpoint")           # or ModelConfig(...) + init_params
    logits = forward(params, config, tokens, attention_mask)  # [B, T, V] float32
    logp = token_logprobs(params, config, tokens, targets)    # [B, T], chunked over the vocab head
    logits, cache = forward_cached(params, config, tokens, cache, num_new)  # prefill / decode

The params tree is documented in `params.py`, padding conventions in `transformer.py`, packed
rows and their block-skipping attention kernel in `packed_attention.py`, the cache layout in
`cache.py`, and the device a program is compiled for, which picks its kernels, in `target.py`.
"""
from rstar2_jax.model.cache import KVCache, forward_cached, init_cache
from rstar2_jax.model.config import ModelConfig
from rstar2_jax.model.hf import load_hf, save_hf
from rstar2_jax.model.logprobs import token_logprobs
from rstar2_jax.model.params import init_params, param_shapes
from rstar2_jax.model.transformer import forward, hidden_states, logits_from_hidden

__all__ = [
    "KVCache", "ModelConfig", "forward", "forward_cached", "hidden_states",
    "init_cache", "init_params", "load_hf", "logits_from_hidden", "param_shapes", "save_hf",
    "token_logprobs",
]
