"""Checkpoints as they are published: real config.json files, bf16 shards with an index, the
dtype field of either transformers generation, generation_config.json eos ids, and loading one
shard at a time."""
import json
import math
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from helpers_hf import make_tiny_hf_checkpoint
from rstar2_jax.errors import ModelError
from rstar2_jax.model import hf, load_hf, param_shapes
from rstar2_jax.model.hf import read_hf_config

# config.json of the published checkpoints (Hugging Face Hub, Qwen organisation), as written by
# the transformers version of their release.
_QWEN3_COMMON = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "initializer_range": 0.02, "max_position_embeddings": 40960, "model_type": "qwen3",
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}
_QWEN3_SIZES = {
    "0.6B": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, max_window_layers=28, tie_word_embeddings=True),
    "4B": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
               num_attention_heads=32, max_window_layers=36, tie_word_embeddings=True),
    "8B": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
               num_attention_heads=32, max_window_layers=36, tie_word_embeddings=False),
    "14B": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                num_attention_heads=40, max_window_layers=40, tie_word_embeddings=False),
}
_QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02,
    "intermediate_size": 18944, "max_position_embeddings": 131072, "max_window_layers": 28,
    "model_type": "qwen2", "num_attention_heads": 28, "num_hidden_layers": 28,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.40.1", "use_cache": True, "use_mrope": False,
    "use_sliding_window": False, "vocab_size": 152064,
}
PUBLISHED = {
    "Qwen2.5-7B": _QWEN25_7B,
    # The math model: Qwen2.5-7B's shapes with a 4K context and rope_theta 10000.
    "Qwen2.5-Math-7B": _QWEN25_7B | {"max_position_embeddings": 4096, "rope_theta": 10000,
                                     "sliding_window": 4096, "transformers_version": "4.37.0"},
    **{f"Qwen3-{size}": _QWEN3_COMMON | dims for size, dims in _QWEN3_SIZES.items()},
    # The base models differ only in their end-of-sequence token and context.
    **{f"Qwen3-{size}-Base": _QWEN3_COMMON | dims | {"eos_token_id": 151643,
                                                    "max_position_embeddings": 32768}
       for size, dims in _QWEN3_SIZES.items()},
}
# (total, non-embedding) in billions as the model cards print them, and the exact total where
# the checkpoint's index gives it (model.safetensors.index.json total_size / 2 bytes per bf16).
CARD = {
    "Qwen2.5-7B": ("7.61", "6.53", 7_615_616_512),
    "Qwen2.5-Math-7B": ("7.61", "6.53", 7_615_616_512),
    "Qwen3-0.6B": ("0.6", "0.44", None),
    "Qwen3-4B": ("4.0", "3.6", None),
    "Qwen3-8B": ("8.2", "6.95", 8_190_735_360),
    "Qwen3-14B": ("14.8", "13.2", 14_768_307_200),
}


def _write(path, config, generation=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    return path


def _count(tree) -> int:
    return sum(math.prod(s) for s in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, tuple)))


def _near(value: float, card: str) -> bool:
    """Whether `value` (billions) is what a card printing `card` means: within one unit of the
    card's last digit (the cards round some figures and truncate others)."""
    unit = 10.0 ** -len(card.split(".")[1])
    return abs(value - float(card)) < unit


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_configs_give_the_published_parameter_counts(tmp_path, name):
    config = read_hf_config(_write(tmp_path / name, PUBLISHED[name]))
    shapes = param_shapes(config)
    total = _count(shapes)
    embedding = _count(shapes["embed"]) + (0 if config.tie_embeddings else _count(shapes["lm_head"]))
    card_total, card_non_embedding, exact = CARD[name.removesuffix("-Base")]
    assert _near(total / 1e9, card_total), (name, total)
    assert _near((total - embedding) / 1e9, card_non_embedding), (name, total - embedding)
    if exact is not None:
        assert total == exact
    assert config.vocab_size == PUBLISHED[name]["vocab_size"]
    assert config.qk_norm == name.startswith("Qwen3") and config.attention_bias == name.startswith("Qwen2")


def test_generation_config_eos_ids_win_and_may_be_a_list(tmp_path):
    qwen3_14b = _QWEN3_COMMON | _QWEN3_SIZES["14B"]
    generation = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
                  "pad_token_id": 151643, "temperature": 0.6, "top_k": 20, "top_p": 0.95}
    config = read_hf_config(_write(tmp_path / "chat", qwen3_14b, generation))
    assert config.eos_token_id == (151645, 151643)
    base = read_hf_config(_write(tmp_path / "base", qwen3_14b | {"eos_token_id": 151643},
                                 {"bos_token_id": 151643, "eos_token_id": 151643}))
    assert base.eos_token_id == 151643
    assert read_hf_config(_write(tmp_path / "none", qwen3_14b)).eos_token_id == 151645


def _bf16_sharded(path, dtype_field: str):
    """A tiny random Qwen3 saved by transformers in bfloat16, sharded with an index, with its
    dtype under `dtype_field` ("dtype" as transformers 5 writes it, "torch_dtype" as 4.x did)."""
    fp32 = make_tiny_hf_checkpoint(path / "fp32", "qwen3", seed=5)
    model = transformers.AutoModelForCausalLM.from_pretrained(fp32, dtype=torch.bfloat16)
    model.save_pretrained(path / "bf16", max_shard_size="30KB")
    config_file = path / "bf16" / "config.json"
    config = json.loads(config_file.read_text())
    config.pop("dtype", None), config.pop("torch_dtype", None)
    config_file.write_text(json.dumps(config | {dtype_field: "bfloat16"}))
    return path / "bf16", {k: v.float().numpy() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("dtype_field", ["dtype", "torch_dtype"])
def test_bf16_shards_with_an_index_load_exactly(tmp_path, dtype_field):
    path, reference = _bf16_sharded(tmp_path, dtype_field)
    assert (path / "model.safetensors.index.json").exists() and len(list(path.glob("*.safetensors"))) > 2
    config, params = load_hf(path, dtype=jnp.bfloat16)
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    # bf16 -> bf16 is exact; spot-check a stacked, transposed tensor and the embedding.
    np.testing.assert_array_equal(np.asarray(params["embed"], np.float32), reference["model.embed_tokens.weight"])
    q1 = reference["model.layers.1.self_attn.q_proj.weight"].T.reshape(params["layers"]["q"].shape[1:])
    np.testing.assert_array_equal(np.asarray(params["layers"]["q"][1], np.float32), q1)
    _, params32 = load_hf(path)  # and widened to float32 on the way in
    np.testing.assert_array_equal(np.asarray(params32["layers"]["q"][1]), q1)


def test_loading_reads_one_shard_and_one_tensor_at_a_time(tmp_path, monkeypatch):
    path, _ = _bf16_sharded(tmp_path, "dtype")
    shards = len(list(path.glob("*.safetensors")))
    opened, alive, peak_open, peak_alive = [0], [], [0], [0]
    real_safe_open = hf.safe_open

    class Counting:
        def __init__(self, *args, **kwargs):
            self.handle = real_safe_open(*args, **kwargs)

        def __enter__(self):
            opened[0] += 1
            peak_open[0] = max(peak_open[0], opened[0])
            self.inner = self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            opened[0] -= 1
            return self.handle.__exit__(*exc)

        def get_slice(self, name):
            return self.inner.get_slice(name)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, name):
            # Tensors read earlier and still referenced by the loader count as held.
            held = [r for r in alive if r() is not None]
            peak_alive[0] = max(peak_alive[0], len(held))
            tensor = self.inner.get_tensor(name)
            alive.append(weakref.ref(tensor))
            return tensor

    monkeypatch.setattr(hf, "safe_open", Counting)
    load_hf(path)
    assert shards > 2 and peak_open[0] == 1
    assert peak_alive[0] == 0  # each raw tensor is dropped before the next one is read
    assert len(alive) == len(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"])


def test_missing_directory_and_files_are_named(tmp_path):
    with pytest.raises(ModelError, match=f"model directory {tmp_path / 'nope'} does not exist"):
        load_hf(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="config.json does not exist"):
        load_hf(tmp_path / "empty")
    path = make_tiny_hf_checkpoint(tmp_path / "ckpt", "qwen3", max_shard_size="20KB")
    next(path.glob("model-0000*.safetensors")).unlink()
    with pytest.raises(ModelError, match="lists shard"):
        load_hf(path)
    (path / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="config.json is not readable JSON"):
        load_hf(path)
