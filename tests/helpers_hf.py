"""Tiny random Qwen2/Qwen3 models for tests: Hugging Face checkpoints built locally (no
download) and their reference logits from `transformers`, or a random rstar2_jax model directly.

Uses torch + transformers, so import it only from tests.
"""
from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from rstar2_jax.model import ModelConfig, init_params

# Small enough to compile in seconds; GQA ratio 2 and head_dim != hidden / heads by default.
TINY_DEFAULTS = dict(
    vocab_size=128,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def make_tiny_hf_checkpoint(path, model_type: str, *, seed: int = 0, rope_theta: float = 10_000.0,
                            max_shard_size: str | None = None, **overrides) -> Path:
    """Writes a random `model_type` ("qwen2" | "qwen3") checkpoint to `path` and returns the path.

    `overrides` are HF config fields (e.g. num_key_value_heads=1, tie_word_embeddings=True).
    Every tensor is random, including norm scales (around 1) and biases, so a mis-mapped
    tensor changes the logits. `max_shard_size` (e.g. "20KB") writes a sharded checkpoint.
    """
    config_cls = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[model_type]
    config = config_cls(**(TINY_DEFAULTS | overrides),
                        rope_parameters={"rope_type": "default", "rope_theta": rope_theta})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return Path(path)


def hf_logits(path, tokens: np.ndarray, attention_mask: np.ndarray | None = None) -> np.ndarray:
    """float32 logits [B, T, V] from `transformers` (PyTorch CPU, fp32, eager attention).

    Positions are cumsum(mask) - 1, as in rstar2_jax, so left padding is handled.
    """
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    if attention_mask is None:
        attention_mask = np.ones_like(tokens)
    positions = np.maximum(np.cumsum(attention_mask, axis=1) - 1, 0)
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(np.asarray(tokens, np.int64)),
                    attention_mask=torch.as_tensor(np.asarray(attention_mask, np.int64)),
                    position_ids=torch.as_tensor(positions, dtype=torch.int64))
    return out.logits.float().numpy()


def tiny_random_model(model_type: str, dtype: str = "float32", **overrides):
    """(config, params) of a tiny random rstar2_jax model: Qwen2 with q/k/v biases, Qwen3 with
    q/k norms, GQA ratio 2. Every leaf is random, norm scales and biases included, so none is an
    identity by accident. `overrides` are ModelConfig fields."""
    config = ModelConfig(**(dict(
        model_type=model_type, vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=10_000.0,
        attention_bias=model_type == "qwen2", qk_norm=model_type == "qwen3", dtype=dtype) | overrides))
    rng = np.random.default_rng(1)
    params = jax.tree.map(lambda x: x + jnp.asarray(0.1 * rng.standard_normal(x.shape), x.dtype),
                          init_params(config, jax.random.key(0)))
    return config, params
