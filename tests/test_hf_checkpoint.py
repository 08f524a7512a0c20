"""load_hf / save_hf: round trips through transformers, sharded files, dtypes and clear errors."""
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

from helpers_hf import hf_logits, make_tiny_hf_checkpoint
from rstar2_jax.model import forward, load_hf, save_hf


@pytest.mark.parametrize("model_type, tied", [("qwen2", True), ("qwen3", False)])
def test_round_trip_opens_in_transformers_with_the_same_logits(tmp_path, model_type, tied):
    original = make_tiny_hf_checkpoint(tmp_path / "original", model_type, tie_word_embeddings=tied)
    config, params = load_hf(original)
    save_hf(tmp_path / "saved", config, params)

    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (2, 19)).astype(np.int32)
    saved_logits = hf_logits(tmp_path / "saved", tokens)
    np.testing.assert_allclose(saved_logits, hf_logits(original, tokens), atol=1e-6)
    np.testing.assert_allclose(np.asarray(forward(params, config, jnp.asarray(tokens))), saved_logits, atol=1e-4)
    reloaded_config, reloaded = load_hf(tmp_path / "saved")
    assert reloaded_config == config
    jax.tree.map(np.testing.assert_array_equal, reloaded, params)


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path):
    single = make_tiny_hf_checkpoint(tmp_path / "single", "qwen3", seed=3)
    sharded = make_tiny_hf_checkpoint(tmp_path / "sharded", "qwen3", seed=3, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) > 1

    (_, a), (_, b) = load_hf(single), load_hf(sharded)
    jax.tree.map(np.testing.assert_array_equal, a, b)


def test_loads_in_bfloat16(tmp_path):
    path = make_tiny_hf_checkpoint(tmp_path / "ckpt", "qwen2")
    config, params = load_hf(path, dtype=jnp.bfloat16)
    _, params32 = load_hf(path)
    assert config.dtype == "bfloat16"
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(x, y.astype(jnp.bfloat16)), params, params32)


def test_loading_never_imports_torch(tmp_path):
    path = make_tiny_hf_checkpoint(tmp_path / "ckpt", "qwen3")
    code = ("import sys; from rstar2_jax.model import load_hf; load_hf(sys.argv[1]); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code, str(path)], check=True)


def _rewrite_tensors(path, edit):
    file = path / "model.safetensors"
    tensors = safetensors.numpy.load_file(file)
    edit(tensors)
    safetensors.numpy.save_file(tensors, file, metadata={"format": "pt"})


def test_missing_tensor_is_named(tmp_path):
    path = make_tiny_hf_checkpoint(tmp_path / "ckpt", "qwen3")
    _rewrite_tensors(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_hf(path)


def test_shape_mismatch_is_named(tmp_path):
    path = make_tiny_hf_checkpoint(tmp_path / "ckpt", "qwen2")
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] += 8
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight.*shape"):
        load_hf(path)


def test_unexpected_tensor_is_named(tmp_path):
    path = make_tiny_hf_checkpoint(tmp_path / "ckpt", "qwen3")
    _rewrite_tensors(path, lambda t: t.update({"model.layers.0.mlp.experts.0.weight": np.zeros(4, np.float32)}))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.0\.weight"):
        load_hf(path)


def test_unknown_model_type_is_refused(tmp_path):
    path = make_tiny_hf_checkpoint(tmp_path / "ckpt", "qwen3")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"model_type": "llama"}))
    with pytest.raises(ValueError, match="llama"):
        load_hf(path)


def test_save_refuses_params_that_do_not_fit_the_config(tmp_path):
    path = make_tiny_hf_checkpoint(tmp_path / "ckpt", "qwen3")
    config, params = load_hf(path)
    params["layers"]["q"] = params["layers"]["q"][:, :, :1]
    with pytest.raises(ValueError, match=r"\['layers'\]\['q'\]"):
        save_hf(tmp_path / "out", config, params)
