"""The params pytree of the decoder, one table row per param (`PARAMS`): its shape, its logical
sharding axes, its initialisation and the Hugging Face tensor it is stored as. `param_shapes`,
`init_params`, the partition specs (`rstar2_jax.parallel.sharding`) and the checkpoint reader and
writer (`rstar2_jax.model.hf`) all read this table.

The params are plain nested dicts of arrays: the top-level params, and ``params["layers"]``,
the decoder layers stacked on a leading `[num_layers]` axis so the layer loop is one
`jax.lax.scan` (one layer to compile, not L). Dimensions, by `ModelConfig` size: H = num_heads,
K = num_kv_heads, D = head_dim, E = hidden_size, F = intermediate_size, V = vocab_size,
L = num_layers. Weights are stored input-axis first (`x @ w`), with heads kept as their own
axis so tensor parallelism can split them by name.

Logical axes (mesh axes of the same names, `rstar2_jax.parallel.sharding`): ``fsdp`` splits
params and optimizer state over the data-parallel devices (each param on one axis), ``tp`` is
Megatron tensor parallelism: q, k, v, gate, up column-parallel (heads / intermediate over tp),
o, down row-parallel, embed and lm_head over the vocabulary; norms are replicated (tiny).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from rstar2_jax.model.config import ModelConfig

_INIT_STD = 0.02  # the Qwen checkpoints' `initializer_range`


@dataclasses.dataclass(frozen=True)
class Param:
    """One param of the decoder.

    name: its key (under ``params["layers"]`` when stacked).
    dims: its dimensions by `ModelConfig` size (one layer's; a stacked param has L first).
    axes: the logical mesh axis of each of ``dims``: "fsdp", "tp" or None (replicated).
    hf_name: the `transformers` tensor; ``{i}``, the layer index, marks a stacked param.
    hf_layout: how that tensor lays it out (`rstar2_jax.model.hf`): "same", "flat" (a vector,
      ours maybe [heads, head_dim]) or "linear" / "linear2" (torch's [out, in] of a weight
      with 1 / 2 input axes).
    init: "normal" (std 0.02), "ones" or "zeros".
    when: the `ModelConfig` property the param exists under (None: always).
    """

    name: str
    dims: str
    axes: tuple[str | None, ...]
    hf_name: str
    hf_layout: str
    init: str
    when: str | None = None

    @property
    def stacked(self) -> bool:
        return "{i}" in self.hf_name

    def shape(self, config: ModelConfig) -> tuple[int, ...]:
        c = config
        size = {"V": c.vocab_size, "E": c.hidden_size, "H": c.num_heads, "K": c.num_kv_heads,
                "D": c.head_dim, "F": c.intermediate_size}
        return ((c.num_layers,) if self.stacked else ()) + tuple(size[d] for d in self.dims.split())


_LAYER = "model.layers.{i}."
PARAMS = (
    #     name          dims     axes                  HF tensor                                   layout     init
    Param("embed",      "V E",   ("tp", "fsdp"),       "model.embed_tokens.weight",                "same",    "normal"),
    Param("final_norm", "E",     (None,),              "model.norm.weight",                        "flat",    "ones"),
    Param("lm_head",    "E V",   ("fsdp", "tp"),       "lm_head.weight",                           "linear",  "normal", "untied_embeddings"),
    Param("attn_norm",  "E",     (None,),              _LAYER + "input_layernorm.weight",          "flat",    "ones"),
    Param("q",          "E H D", ("fsdp", "tp", None), _LAYER + "self_attn.q_proj.weight",         "linear",  "normal"),
    Param("k",          "E K D", ("fsdp", "tp", None), _LAYER + "self_attn.k_proj.weight",         "linear",  "normal"),
    Param("v",          "E K D", ("fsdp", "tp", None), _LAYER + "self_attn.v_proj.weight",         "linear",  "normal"),
    Param("q_bias",     "H D",   ("tp", None),         _LAYER + "self_attn.q_proj.bias",           "flat",    "zeros", "attention_bias"),
    Param("k_bias",     "K D",   ("tp", None),         _LAYER + "self_attn.k_proj.bias",           "flat",    "zeros", "attention_bias"),
    Param("v_bias",     "K D",   ("tp", None),         _LAYER + "self_attn.v_proj.bias",           "flat",    "zeros", "attention_bias"),
    Param("q_norm",     "D",     (None,),              _LAYER + "self_attn.q_norm.weight",         "flat",    "ones", "qk_norm"),
    Param("k_norm",     "D",     (None,),              _LAYER + "self_attn.k_norm.weight",         "flat",    "ones", "qk_norm"),
    Param("o",          "H D E", ("tp", None, "fsdp"), _LAYER + "self_attn.o_proj.weight",         "linear2", "normal"),
    Param("mlp_norm",   "E",     (None,),              _LAYER + "post_attention_layernorm.weight", "flat",    "ones"),
    Param("gate",       "E F",   ("fsdp", "tp"),       _LAYER + "mlp.gate_proj.weight",            "linear",  "normal"),
    Param("up",         "E F",   ("fsdp", "tp"),       _LAYER + "mlp.up_proj.weight",              "linear",  "normal"),
    Param("down",       "F E",   ("tp", "fsdp"),       _LAYER + "mlp.down_proj.weight",            "linear",  "normal"),
)


def model_params(config: ModelConfig) -> list[Param]:
    """The rows of `PARAMS` this config has (Qwen2's biases, Qwen3's q/k norms, an untied head)."""
    return [p for p in PARAMS if p.when is None or getattr(config, p.when)]


def params_tree(config: ModelConfig, value) -> dict:
    """A pytree with the structure of the params: ``value(param)`` at each param's place."""
    tree: dict = {"layers": {}}
    for p in model_params(config):
        (tree["layers"] if p.stacked else tree)[p.name] = value(p)
    return tree


def param_shapes(config: ModelConfig) -> dict:
    """The shape of every param, as a pytree of tuples with the structure of the params."""
    return params_tree(config, lambda p: p.shape(config))


@functools.partial(jax.jit, static_argnames="config")
def init_params(config: ModelConfig, key: jax.Array) -> dict:
    """Random params: normal(0, 0.02) weights, unit norm scales, zero biases.

    For tests and toy models: it draws all weights at once, so it needs twice the params' memory.
    """
    rows, treedef = jax.tree.flatten(params_tree(config, lambda p: p),
                                     is_leaf=lambda x: isinstance(x, Param))
    shapes = [p.shape(config) for p in rows]
    sizes = [math.prod(shape) for shape in shapes]
    # One draw sliced into leaves: a random op per leaf would compile one PRNG kernel per leaf.
    noise = jnp.split(jax.random.normal(key, (sum(sizes),), jnp.float32), np.cumsum(sizes)[:-1])
    leaves = [_init_leaf(p.init, shape, z, config.jnp_dtype) for p, shape, z in zip(rows, shapes, noise)]
    return jax.tree.unflatten(treedef, leaves)


def _init_leaf(init: str, shape: tuple[int, ...], noise: jax.Array, dtype) -> jax.Array:
    if init == "ones":
        return jnp.ones(shape, dtype)
    if init == "zeros":
        return jnp.zeros(shape, dtype)
    return (_INIT_STD * noise).reshape(shape).astype(dtype)
