"""Architecture hyper-parameters of a Qwen2 / Qwen3 dense decoder, and their Hugging Face form.

`ModelConfig` is frozen and hashable so it can be a static argument of `jax.jit`. It is read
from and written to the `config.json` that `transformers` uses. Checkpoint features this model
does not implement (rope scaling, sliding-window attention, mixture of experts, activations other
than SiLU, Qwen3 attention biases) raise `ValueError` instead of being silently ignored.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# XLA's names; on a GPU "default" and "high" are TF32 matmuls, on a TPU one and three bfloat16
# passes; "highest" is a true float32 matmul everywhere (a CPU computes float32 in any case).
MATMUL_PRECISIONS = ("highest", "high", "default")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A Qwen2 or Qwen3 dense decoder.

    `dtype` is the compute dtype: the activations between layers, and the dtype every weight is
    cast to where it is used (a no-op when the params are stored in it). Params may be stored
    in another dtype (float32 master weights under bfloat16 compute): the cast happens inside
    the differentiated function, so gradients come back in the params' own dtype. RMSNorm,
    RoPE, the attention softmax, the output logits and log-probs are always float32.
    `matmul_precision` is the precision of matmuls when `dtype` is float32 (one of
    `MATMUL_PRECISIONS`); bfloat16 matmuls always multiply bfloat16 and accumulate in float32.
    `attention_bias` means biases on the q/k/v projections (always on in Qwen2 checkpoints);
    `qk_norm` is Qwen3's per-head RMSNorm of queries and keys before RoPE.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 32768
    dtype: str = "float32"
    matmul_precision: str = "highest"
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.model_type not in _ARCHITECTURES:
            raise ValueError(f"model_type {self.model_type!r} is not supported; "
                             f"expected one of {sorted(_ARCHITECTURES)}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not supported; expected one of {sorted(_DTYPES)}")
        if self.matmul_precision not in MATMUL_PRECISIONS:
            raise ValueError(f"matmul_precision {self.matmul_precision!r} is not supported; "
                             f"expected one of {', '.join(MATMUL_PRECISIONS)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")
        if isinstance(self.eos_token_id, list):  # keep the config hashable
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))

    @property
    def jnp_dtype(self):
        return _DTYPES[self.dtype]

    @property
    def untied_embeddings(self) -> bool:
        """The output head is a param of its own (``lm_head``), not the embedding table."""
        return not self.tie_embeddings

    @property
    def precision(self) -> jax.lax.Precision | None:
        """The `precision=` of every matmul of this model: `matmul_precision` in float32, the
        backend's bfloat16 default (None) otherwise."""
        if self.dtype != "float32":
            return None
        return jax.lax.Precision[self.matmul_precision.upper()]

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], dtype: str = "float32") -> ModelConfig:
        """Reads a `transformers` config dict (the contents of `config.json`).

        `dtype` is the dtype to compute in here; the checkpoint's own `torch_dtype` is ignored.
        """
        model_type = d.get("model_type")
        if model_type not in _ARCHITECTURES:
            raise ValueError(f"model_type {model_type!r} is not supported; "
                             f"expected one of {sorted(_ARCHITECTURES)}")
        _reject_unsupported(d)
        num_heads = d["num_attention_heads"]
        rope = d.get("rope_parameters") or {}
        return cls(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // num_heads,
            rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10_000.0))),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            tie_embeddings=d.get("tie_word_embeddings", False),
            attention_bias=model_type == "qwen2",
            qk_norm=model_type == "qwen3",
            max_position_embeddings=d.get("max_position_embeddings", 32768),
            dtype=dtype,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The `config.json` contents that `transformers.AutoModelForCausalLM` opens as this model."""
        if self.attention_bias != (self.model_type == "qwen2") or self.qk_norm != (self.model_type == "qwen3"):
            raise ValueError(
                f"{self.model_type} checkpoints cannot express attention_bias={self.attention_bias}, "
                f"qk_norm={self.qk_norm} (Qwen2 has q/k/v biases and no q/k norm, Qwen3 the reverse)")
        d = {
            "architectures": [_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "use_sliding_window": False,
            "dtype": self.dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }
        if self.model_type == "qwen3":
            d["attention_bias"] = False
        return d


def _reject_unsupported(d: dict[str, Any]) -> None:
    """Raises if the HF config asks for something `forward` does not compute."""
    problems = []
    if d.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={d['hidden_act']!r} (only 'silu')")
    rope = d.get("rope_parameters") or {}
    if d.get("rope_scaling") or rope.get("rope_type", "default") != "default":
        problems.append(f"rope scaling {d.get('rope_scaling') or rope}")
    if d.get("use_sliding_window") or any(t != "full_attention" for t in d.get("layer_types") or []):
        problems.append("sliding-window attention")
    if d.get("num_experts") or d.get("num_local_experts"):
        problems.append("mixture of experts")
    if d["model_type"] == "qwen3" and d.get("attention_bias"):
        problems.append("Qwen3 attention_bias=True (biases on q/k/v/o projections)")
    if problems:
        raise ValueError("unsupported checkpoint features: " + "; ".join(problems))
