"""The params pytree of the decoder: its shapes and a random initialisation.

The params are plain nested dicts of arrays. Decoder layers are stacked on a leading
`[num_layers]` axis so the layer loop is one `jax.lax.scan` (one layer to compile, not L).
With H = num_heads, K = num_kv_heads, D = head_dim, E = hidden_size, F = intermediate_size,
V = vocab_size, L = num_layers:

    embed              [V, E]          token embedding (also the output head when tied)
    layers/
      attn_norm        [L, E]          RMSNorm scale before attention
      q                [L, E, H, D]    query projection
      k, v             [L, E, K, D]    key / value projections
      q_bias           [L, H, D]       only when config.attention_bias (Qwen2)
      k_bias, v_bias   [L, K, D]       only when config.attention_bias (Qwen2)
      q_norm, k_norm   [L, D]          only when config.qk_norm (Qwen3)
      o                [L, H, D, E]    attention output projection
      mlp_norm         [L, E]          RMSNorm scale before the MLP
      gate, up         [L, E, F]       SwiGLU input projections
      down             [L, F, E]       SwiGLU output projection
    final_norm         [E]             RMSNorm scale before the output head
    lm_head            [E, V]          only when not config.tie_embeddings

Weights are stored input-axis first (`x @ w`), with heads kept as their own axis so tensor
parallelism can split them by name.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from rstar2_jax.model.config import ModelConfig

_INIT_STD = 0.02  # the Qwen checkpoints' `initializer_range`


def param_shapes(config: ModelConfig) -> dict:
    """The shape of every param, as a pytree of tuples with the structure of the params."""
    c = config
    L, E, H, K, D, F, V = (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                           c.intermediate_size, c.vocab_size)
    layers = {
        "attn_norm": (L, E),
        "q": (L, E, H, D),
        "k": (L, E, K, D),
        "v": (L, E, K, D),
        "o": (L, H, D, E),
        "mlp_norm": (L, E),
        "gate": (L, E, F),
        "up": (L, E, F),
        "down": (L, F, E),
    }
    if c.attention_bias:
        layers |= {"q_bias": (L, H, D), "k_bias": (L, K, D), "v_bias": (L, K, D)}
    if c.qk_norm:
        layers |= {"q_norm": (L, D), "k_norm": (L, D)}
    shapes = {"embed": (V, E), "layers": layers, "final_norm": (E,)}
    if not c.tie_embeddings:
        shapes["lm_head"] = (E, V)
    return shapes


@functools.partial(jax.jit, static_argnames="config")
def init_params(config: ModelConfig, key: jax.Array) -> dict:
    """Random params: normal(0, 0.02) weights, unit norm scales, zero biases.

    For tests and toy models: it draws all weights at once, so it needs twice the params' memory.
    """
    path_shapes, treedef = jax.tree_util.tree_flatten_with_path(
        param_shapes(config), is_leaf=lambda x: isinstance(x, tuple))
    sizes = [math.prod(shape) for _, shape in path_shapes]
    # One draw sliced into leaves: a random op per leaf would compile one PRNG kernel per leaf.
    noise = jnp.split(jax.random.normal(key, (sum(sizes),), jnp.float32), np.cumsum(sizes)[:-1])
    leaves = [_init_leaf(path[-1].key, shape, z, config.jnp_dtype)
              for (path, shape), z in zip(path_shapes, noise)]
    return jax.tree.unflatten(treedef, leaves)


def _init_leaf(name: str, shape: tuple[int, ...], noise: jax.Array, dtype) -> jax.Array:
    if name.endswith("norm"):
        return jnp.ones(shape, dtype)
    if name.endswith("bias"):
        return jnp.zeros(shape, dtype)
    return (_INIT_STD * noise).reshape(shape).astype(dtype)
