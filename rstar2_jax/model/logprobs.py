"""Per-token log-probabilities of given targets without materialising [batch, seq, vocab].

This is the training-loss path. With Qwen's 152k vocabulary the float32 logits of a long batch
are the memory peak, so the hidden states are computed once and the output head + log-softmax
run over sequence chunks. Each chunk is rematerialised in the backward pass, so at most one
chunk's [B, chunk, V] logits are alive in either direction.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from rstar2_jax.model.config import ModelConfig
from rstar2_jax.model.transformer import hidden_states, logits_from_hidden


@functools.partial(jax.jit, static_argnames=("config", "chunk_size", "return_entropy", "remat"))
def token_logprobs(params: dict, config: ModelConfig, tokens: jax.Array, targets: jax.Array,
                   attention_mask: jax.Array | None = None, *, lengths: jax.Array | None = None,
                   segment_lengths: jax.Array | None = None, chunk_size: int = 256, temperature: float = 1.0, return_entropy: bool = False,
                   remat: bool = False):
    """logp [B, T] float32 with logp[b, t] = log softmax(logits[b, t] / temperature)[targets[b, t]].

    tokens, targets int32 [B, T] (targets are usually tokens shifted left by one);
    attention_mask [B, T], lengths [B] or segment_lengths [B, M] as in `forward` (the training
    path passes lengths for right-padded rows, segment_lengths for packed ones). Values at pad positions are garbage. The model computes in
    `config.dtype`; the logits, log-softmax and log-probs are float32.
    With `return_entropy`, returns (logp, entropy) where entropy [B, T] is the entropy of the
    same tempered distribution, in nats. Differentiable; `remat` as in `forward`.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    hidden = hidden_states(params, config, tokens, attention_mask, lengths=lengths,
                           segment_lengths=segment_lengths, remat=remat)
    batch, seq = tokens.shape
    chunk = min(chunk_size, seq)
    num_chunks = -(-seq // chunk)
    pad = num_chunks * chunk - seq

    def chunked(x):  # [B, T, ...] -> [num_chunks, B, chunk, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.swapaxes(x.reshape(batch, num_chunks, chunk, *x.shape[2:]), 0, 1)

    @jax.checkpoint
    def one_chunk(args):
        h, tgt = args  # [B, chunk, E], [B, chunk]
        logp_all = jax.nn.log_softmax(logits_from_hidden(params, config, h) / temperature, axis=-1)
        logp = jnp.take_along_axis(logp_all, tgt[..., None], axis=-1)[..., 0]
        entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
        return logp, entropy

    logp, entropy = jax.lax.map(one_chunk, (chunked(hidden), chunked(targets)))

    def unchunked(x):  # [num_chunks, B, chunk] -> [B, T]
        return jnp.swapaxes(x, 0, 1).reshape(batch, num_chunks * chunk)[:, :seq]

    if return_entropy:
        return unchunked(logp), unchunked(entropy)
    return unchunked(logp)
