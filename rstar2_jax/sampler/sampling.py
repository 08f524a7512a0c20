"""Choosing the next token from logits: greedy, temperature, top-k and top-p.

Pure functions of arrays, jit-able; the sampling settings are static (hashable) so that a decode
loop compiles once per setting.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens.

    temperature: 0 means greedy (argmax); otherwise logits are divided by it before sampling.
    top_k: keep only the k most likely tokens (0 = no limit).
    top_p: keep the smallest set of most likely tokens whose probability reaches top_p (1 = all).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _truncate(scaled: jax.Array, top_k: int, top_p: float) -> jax.Array:
    """Sets logits outside the top-k / top-p set to -inf. `scaled` is `[batch, vocab]`."""
    if top_k > 0 and top_k < scaled.shape[-1]:
        kth = jax.lax.top_k(scaled, top_k)[0][:, -1:]
        scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
    if top_p < 1.0:
        sorted_logits = jnp.sort(scaled, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        # Mass strictly before each sorted token: a token is kept while that mass is < top_p, so
        # the most likely token is always kept.
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        kept = mass_before < top_p
        cutoff = jnp.min(jnp.where(kept, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        scaled = jnp.where(scaled < cutoff, -jnp.inf, scaled)
    return scaled


def sample_tokens(
    keys: jax.Array, logits: jax.Array, params: SamplingParams
) -> tuple[jax.Array, jax.Array]:
    """Picks one token per row.

    Args:
      keys: `[batch]` PRNG keys (raw `uint32[batch, 2]`), one per row, so that a row's draw does
        not depend on which other rows share the batch.
      logits: `[batch, vocab]` float32.
      params: static sampling settings.

    Returns:
      tokens `[batch]` int32 and their log-probabilities `[batch]` float32 under the
      temperature-scaled, untruncated distribution `log_softmax(logits / T)` (T = 1 when greedy).
      That is the quantity the trainer recomputes with `token_logprobs(..., temperature=T)`; with
      top-k / top-p the sampled-from distribution is the renormalised truncation of it.
    """
    logits = logits.astype(jnp.float32)
    if params.greedy:
        tokens = jnp.argmax(logits, axis=-1)
        scaled = logits
    else:
        scaled = logits / params.temperature
        truncated = _truncate(scaled, params.top_k, params.top_p)
        tokens = jax.vmap(jax.random.categorical)(keys, truncated)
    logp = jnp.take_along_axis(jax.nn.log_softmax(scaled, axis=-1), tokens[:, None], axis=-1)
    return tokens.astype(jnp.int32), logp[:, 0]
