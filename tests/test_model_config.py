"""ModelConfig reads and writes HF config dicts and refuses what the model does not compute."""
import pytest
import transformers

from rstar2_jax.model import ModelConfig


def _hf_dict(model_type="qwen3", **overrides):
    cls = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[model_type]
    return cls(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
               rope_parameters={"rope_type": "default", "rope_theta": 12_345.0},
               bos_token_id=1, eos_token_id=[2, 3], **overrides).to_dict()


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_reads_transformers_config(model_type):
    config = ModelConfig.from_hf_dict(_hf_dict(model_type), dtype="bfloat16")
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (2, 4, 2, 16)
    assert config.rope_theta == 12_345.0
    assert config.tie_embeddings and config.dtype == "bfloat16"
    assert config.attention_bias == (model_type == "qwen2")
    assert config.qk_norm == (model_type == "qwen3")
    assert config.eos_token_id == (2, 3)
    assert ModelConfig.from_hf_dict(config.to_hf_dict(), dtype="bfloat16") == config


def test_reads_legacy_top_level_rope_theta():
    d = _hf_dict()
    del d["rope_parameters"]
    d["rope_theta"] = 5e5
    assert ModelConfig.from_hf_dict(d).rope_theta == 5e5


@pytest.mark.parametrize("change, message", [
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope scaling"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}), "rope scaling"),
    (dict(use_sliding_window=True, sliding_window=128), "sliding-window"),
    (dict(layer_types=["full_attention", "sliding_attention"]), "sliding-window"),
    (dict(num_experts=8), "mixture of experts"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(model_type="llama"), "llama"),
])
def test_refuses_unsupported_features(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict(_hf_dict() | change)


def test_rejects_inconsistent_head_counts():
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelConfig(model_type="qwen3", vocab_size=8, hidden_size=8, intermediate_size=8,
                    num_layers=1, num_heads=3, num_kv_heads=2, head_dim=4)
