"""Hugging Face checkpoints: a `transformers` directory <-> `(ModelConfig, params)`.

A checkpoint directory holds `config.json` and either `model.safetensors` or sharded files listed
in `model.safetensors.index.json`. Loading reads the tensors as numpy (never torch). The params
table (`rstar2_jax.model.params.PARAMS`) says which HF tensor becomes which param and how it is
laid out; both directions use it.
"""
from __future__ import annotations

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

from rstar2_jax.errors import ModelError
from rstar2_jax.model.config import ModelConfig
from rstar2_jax.model.params import model_params, param_shapes

GENERATION_CONFIG = "generation_config.json"


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


_LAYOUTS = {"same": _Same(), "flat": _Flat(), "linear": _Linear(1), "linear2": _Linear(2)}


class _Entry(NamedTuple):
    key: str  # our param name; under params["layers"] when `stacked`
    stacked: bool
    shape: tuple[int, ...]  # of one HF tensor's counterpart (one layer's slice when stacked)
    layout: _Linear | _Flat | _Same
    hf_names: list[str]  # one per layer when stacked


def _tensor_map(config: ModelConfig) -> list[_Entry]:
    """The HF tensors behind every param of this config, in `PARAMS` order."""
    entries = []
    for p in model_params(config):
        shape = p.shape(config)
        names = [p.hf_name.format(i=i) for i in range(config.num_layers)] if p.stacked else [p.hf_name]
        entries.append(_Entry(p.name, p.stacked, shape[1:] if p.stacked else shape,
                              _LAYOUTS[p.hf_layout], names))
    return entries


def load_hf(path, dtype=jnp.float32) -> tuple[ModelConfig, dict]:
    """Reads a `transformers` Qwen2/Qwen3 checkpoint directory into (config, params) in `dtype`.

    The checkpoint may be one `model.safetensors` or shards listed in
    `model.safetensors.index.json`, in any float dtype (published ones are bfloat16). Shards are
    read one at a time, one tensor at a time, into host buffers of the params' final dtype, so
    loading needs the params plus one tensor of host memory, never the whole checkpoint.

    Raises ModelError naming the directory or tensor for a missing directory or file, a missing
    tensor, an unexpected tensor (likely a feature this model lacks) or a shape that disagrees
    with config.json.
    """
    path = Path(path)
    config = read_hf_config(path, dtype=jnp.dtype(dtype).name)
    entries = _tensor_map(config)
    files = _tensor_files(path)
    expected = [name for e in entries for name in e.hf_names]
    missing = [name for name in expected if name not in files]
    if missing:
        raise ModelError(f"checkpoint {path} lacks {len(missing)} tensor(s) the config needs: "
                         f"{', '.join(missing[:10])}")
    # Tied checkpoints may still store a copy of the embedding as the output head.
    unexpected = sorted(set(files) - set(expected) - ({"lm_head.weight"} if config.tie_embeddings else set()))
    if unexpected:
        raise ModelError(f"checkpoint {path} has tensor(s) this model does not use (an unsupported "
                         f"feature?): {', '.join(unexpected[:10])}")

    target = {name: (e, layer) for e in entries for layer, name in enumerate(e.hf_names)}
    _check_shapes(path, files, target, expected)
    host_dtype = np.dtype(config.jnp_dtype)
    buffers: dict[str, np.ndarray] = {}
    host = _host_device()
    for file in sorted(set(files.values())):
        names = [name for name, f in files.items() if f == file and name in target]
        # The "flax" reader understands bfloat16, which numpy's does not; it must not put the
        # tensors on an accelerator on their way to the host buffers.
        with safe_open(path / file, framework="flax") as handle, jax.default_device(host):
            for name in names:
                e, layer = target[name]
                a = np.asarray(handle.get_tensor(name))
                ours = e.layout.to_ours(a, e.shape)
                del a
                if e.stacked:
                    if e.key not in buffers:
                        buffers[e.key] = np.empty((config.num_layers, *e.shape), host_dtype)
                    buffers[e.key][layer] = ours
                else:
                    buffers[e.key] = ours.astype(host_dtype)
                del ours
    params = {"layers": {}}
    for e in entries:  # one host buffer at a time becomes a device array
        (params["layers"] if e.stacked else params)[e.key] = jnp.asarray(buffers.pop(e.key))
    return config, params


def _host_device():
    """This process's CPU device (process 0 owns devices()[0]); its first device when JAX runs
    without a CPU backend (JAX_PLATFORMS=cuda), one tensor at a time then."""
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        return jax.local_devices()[0]


def _check_shapes(path: Path, files: dict[str, str], target: dict, order: list[str]) -> None:
    """Raises ModelError naming the first tensor (in table order) whose stored shape disagrees
    with config.json; reads only the files' headers."""
    shapes = {}
    for file in set(files.values()):
        with safe_open(path / file, framework="flax") as handle:
            shapes |= {name: tuple(handle.get_slice(name).get_shape())
                       for name, f in files.items() if f == file and name in target}
    for name in order:
        e, _ = target[name]
        if shapes[name] != e.layout.hf_shape(e.shape):
            raise ModelError(f"tensor {name!r} has shape {shapes[name]} in {path}, but "
                             f"config.json implies {e.layout.hf_shape(e.shape)}")


def read_hf_config(path, dtype: str = "float32") -> ModelConfig:
    """The ModelConfig of a checkpoint directory: `config.json`, with the end-of-sequence ids of
    `generation_config.json` when it has them (they may be a list, and they are what generation
    stops on). Raises ModelError naming the directory or file when either is missing or bad."""
    path = Path(path)
    if not path.is_dir():
        raise ModelError(f"model directory {path} does not exist (model.path must be a local "
                         f"Hugging Face checkpoint directory with config.json and *.safetensors)")
    config_file = path / "config.json"
    d = _read_json(config_file)
    generation_file = path / GENERATION_CONFIG
    if generation_file.exists():
        eos = _read_json(generation_file).get("eos_token_id")
        if eos is not None:
            d = d | {"eos_token_id": eos}
    try:
        return ModelConfig.from_hf_dict(d, dtype=dtype)
    except KeyError as e:
        raise ModelError(f"{config_file} lacks the field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ModelError(f"{config_file}: {e}") from None


def _read_json(file: Path) -> dict:
    if not file.is_file():
        raise ModelError(f"{file} does not exist; a Hugging Face checkpoint directory needs "
                         f"config.json next to its *.safetensors files")
    try:
        d = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"{file} is not readable JSON ({e})") from None
    if not isinstance(d, dict):
        raise ModelError(f"{file} must hold a JSON object, not {type(d).__name__}")
    return d


def save_hf(path, config: ModelConfig, params: dict) -> None:
    """Writes config.json, generation_config.json (the token ids) and model.safetensors that
    `transformers.AutoModelForCausalLM` opens."""
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
    hf_config = config.to_hf_dict()
    (path / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    generation = {k: hf_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (path / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2) + "\n")


def _tensor_files(path: Path) -> dict[str, str]:
    """Maps every tensor name in the checkpoint to the safetensors file holding it."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelError(f"{index} has no weight_map")
        absent = sorted({f for f in weight_map.values() if not (path / f).is_file()})
        if absent:
            raise ModelError(f"{index} lists shard(s) that are not in {path}: {', '.join(absent[:5])}")
        return weight_map
    single = path / "model.safetensors"
    if not single.exists():
        raise ModelError(f"{path} has neither model.safetensors nor model.safetensors.index.json")
    with safe_open(single, framework="flax") as f:
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
