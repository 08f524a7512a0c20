"""Hugging Face checkpoints: a `transformers` directory <-> `(ModelConfig, params)`.

A checkpoint directory holds `config.json` and either `model.safetensors` or sharded files listed
in `model.safetensors.index.json`. Loading reads the tensors as numpy (never torch). One table
says which HF tensor becomes which param and how it is laid out; both directions use it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from safetensors import safe_open

from rstar2_jax.model.config import ModelConfig
from rstar2_jax.model.params import param_shapes


@dataclasses.dataclass(frozen=True)
class _Linear:
    """A torch Linear weight [out, in]; ours is [*in_axes, *out_axes] with `n_in` input axes."""

    n_in: int

    def hf_shape(self, shape):
        return (math.prod(shape[self.n_in:]), math.prod(shape[:self.n_in]))

    def to_ours(self, a, shape):
        return a.T.reshape(shape)

    def to_hf(self, a):
        return a.reshape(self.hf_shape(a.shape)[::-1]).T


@dataclasses.dataclass(frozen=True)
class _Flat:
    """A vector in HF (biases [H*D], norm scales); ours may split it into [heads, head_dim]."""

    def hf_shape(self, shape):
        return (math.prod(shape),)

    def to_ours(self, a, shape):
        return a.reshape(shape)

    def to_hf(self, a):
        return a.reshape(-1)


@dataclasses.dataclass(frozen=True)
class _Same:
    """Stored with the same shape in both (the embedding table [V, E])."""

    def hf_shape(self, shape):
        return tuple(shape)

    def to_ours(self, a, shape):
        return a

    def to_hf(self, a):
        return a


_TOP_LEVEL = (
    ("model.embed_tokens.weight", "embed", _Same()),
    ("model.norm.weight", "final_norm", _Flat()),
    ("lm_head.weight", "lm_head", _Linear(1)),
)
# `{i}` is the layer index; ours are stacked on a leading layer axis.
_PER_LAYER = (
    ("model.layers.{i}.input_layernorm.weight", "attn_norm", _Flat()),
    ("model.layers.{i}.self_attn.q_proj.weight", "q", _Linear(1)),
    ("model.layers.{i}.self_attn.k_proj.weight", "k", _Linear(1)),
    ("model.layers.{i}.self_attn.v_proj.weight", "v", _Linear(1)),
    ("model.layers.{i}.self_attn.q_proj.bias", "q_bias", _Flat()),
    ("model.layers.{i}.self_attn.k_proj.bias", "k_bias", _Flat()),
    ("model.layers.{i}.self_attn.v_proj.bias", "v_bias", _Flat()),
    ("model.layers.{i}.self_attn.q_norm.weight", "q_norm", _Flat()),
    ("model.layers.{i}.self_attn.k_norm.weight", "k_norm", _Flat()),
    ("model.layers.{i}.self_attn.o_proj.weight", "o", _Linear(2)),
    ("model.layers.{i}.post_attention_layernorm.weight", "mlp_norm", _Flat()),
    ("model.layers.{i}.mlp.gate_proj.weight", "gate", _Linear(1)),
    ("model.layers.{i}.mlp.up_proj.weight", "up", _Linear(1)),
    ("model.layers.{i}.mlp.down_proj.weight", "down", _Linear(1)),
)


class _Entry(NamedTuple):
    key: str  # our param name; under params["layers"] when `stacked`
    stacked: bool
    shape: tuple[int, ...]  # of one HF tensor's counterpart (one layer's slice when stacked)
    layout: _Linear | _Flat | _Same
    hf_names: list[str]  # one per layer when stacked


def _tensor_map(config: ModelConfig) -> list[_Entry]:
    """The HF tensors behind every param of this config, in table order."""
    shapes = param_shapes(config)
    entries = [_Entry(key, False, shapes[key], layout, [hf_name])
               for hf_name, key, layout in _TOP_LEVEL if key in shapes]
    entries += [_Entry(key, True, shapes["layers"][key][1:], layout,
                       [hf_name.format(i=i) for i in range(config.num_layers)])
                for hf_name, key, layout in _PER_LAYER if key in shapes["layers"]]
    return entries


def load_hf(path, dtype=jnp.float32) -> tuple[ModelConfig, dict]:
    """Reads a `transformers` Qwen2/Qwen3 checkpoint directory into (config, params) in `dtype`.

    Raises ValueError naming the tensor for a missing tensor, an unexpected tensor (likely a
    feature this model lacks) or a shape that disagrees with config.json.
    """
    path = Path(path)
    config = ModelConfig.from_hf_dict(json.loads((path / "config.json").read_text()),
                                      dtype=jnp.dtype(dtype).name)
    entries = _tensor_map(config)
    files = _tensor_files(path)
    expected = [name for e in entries for name in e.hf_names]
    missing = [name for name in expected if name not in files]
    if missing:
        raise ValueError(f"checkpoint {path} lacks {len(missing)} tensor(s) the config needs: "
                         f"{', '.join(missing[:10])}")
    # Tied checkpoints may still store a copy of the embedding as the output head.
    unexpected = sorted(set(files) - set(expected) - ({"lm_head.weight"} if config.tie_embeddings else set()))
    if unexpected:
        raise ValueError(f"checkpoint {path} has tensor(s) this model does not use (an unsupported "
                         f"feature?): {', '.join(unexpected[:10])}")

    with contextlib.ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(path / f, framework="np")) for f in set(files.values())}

        def read(name: str, e: _Entry) -> np.ndarray:
            a = handles[files[name]].get_tensor(name)
            if a.shape != e.layout.hf_shape(e.shape):
                raise ValueError(f"tensor {name!r} has shape {a.shape} in {path}, but config.json "
                                 f"implies {e.layout.hf_shape(e.shape)}")
            return e.layout.to_ours(a, e.shape).astype(config.jnp_dtype)

        params = {"layers": {}}
        for e in entries:
            if e.stacked:
                params["layers"][e.key] = jnp.asarray(np.stack([read(n, e) for n in e.hf_names]))
            else:
                params[e.key] = jnp.asarray(read(e.hf_names[0], e))
    return config, params


def save_hf(path, config: ModelConfig, params: dict) -> None:
    """Writes config.json and model.safetensors that `transformers.AutoModelForCausalLM` opens."""
    path = Path(path)
    _check_structure(config, params)
    tensors = {}
    for e in _tensor_map(config):
        array = np.asarray(jax.device_get(params["layers"][e.key] if e.stacked else params[e.key]))
        layer_arrays = list(array) if e.stacked else [array]
        for name, a in zip(e.hf_names, layer_arrays, strict=True):
            tensors[name] = np.ascontiguousarray(e.layout.to_hf(a))
    path.mkdir(parents=True, exist_ok=True)
    # transformers refuses safetensors files without a framework tag.
    safetensors.numpy.save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")


def _tensor_files(path: Path) -> dict[str, str]:
    """Maps every tensor name in the checkpoint to the safetensors file holding it."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        return json.loads(index.read_text())["weight_map"]
    single = path / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{path} has neither model.safetensors nor model.safetensors.index.json")
    with safe_open(single, framework="np") as f:
        return {name: single.name for name in f.keys()}


def _check_structure(config: ModelConfig, params: dict) -> None:
    """Raises ValueError naming the first param whose presence or shape disagrees with `config`."""
    expected = param_shapes(config)
    is_shape = lambda x: isinstance(x, tuple)  # noqa: E731
    want = {jax.tree_util.keystr(p): s for p, s in jax.tree_util.tree_flatten_with_path(expected, is_leaf=is_shape)[0]}
    have = {jax.tree_util.keystr(p): a.shape for p, a in jax.tree_util.tree_flatten_with_path(params)[0]}
    for name in sorted(want.keys() | have.keys()):
        if want.get(name) != have.get(name):
            raise ValueError(f"param {name}: shape {have.get(name)} but the config implies {want.get(name)}")
