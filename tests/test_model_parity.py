"""Logit parity with `transformers` (PyTorch CPU, fp32) on tiny random checkpoints."""
import jax.numpy as jnp
import numpy as np
import pytest

from helpers_hf import hf_logits, make_tiny_hf_checkpoint
from rstar2_jax.model import forward, load_hf

TOL = 1e-4

# (model_type, HF config overrides, rope_theta). The default tiny config has hidden 48, so
# head_dim 16 (or 8) never equals hidden / heads (12 or 6).
CASES = {
    "qwen2-tied-gqa1": ("qwen2", dict(tie_word_embeddings=True, num_attention_heads=4,
                                      num_key_value_heads=4), 10_000.0),
    "qwen2-untied-gqa4": ("qwen2", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8),
                          1_000_000.0),
    "qwen3-untied-gqa2": ("qwen3", dict(num_attention_heads=4, num_key_value_heads=2), 500_000.0),
    "qwen3-tied-gqa4": ("qwen3", dict(tie_word_embeddings=True, num_attention_heads=8,
                                      num_key_value_heads=2, head_dim=8), 20_000.0),
}


def _padded_batch(rng, rows, vocab):
    """Random tokens [B, S] and mask from rows of (length, "left" | "right" padding), pad id 0."""
    seq = max(n for n, _ in rows)
    tokens = np.zeros((len(rows), seq), np.int32)
    mask = np.zeros((len(rows), seq), np.int32)
    for b, (n, side) in enumerate(rows):
        cols = slice(seq - n, seq) if side == "left" else slice(0, n)
        tokens[b, cols] = rng.integers(1, vocab, n)
        mask[b, cols] = 1
    return tokens, mask


@pytest.mark.parametrize("case", sorted(CASES))
def test_padded_batch_matches_transformers(tmp_path, case):
    """One batch mixing a full row, a left-padded row and a right-padded row."""
    model_type, overrides, theta = CASES[case]
    path = make_tiny_hf_checkpoint(tmp_path / "ckpt", model_type, rope_theta=theta, **overrides)
    config, params = load_hf(path)
    tokens, mask = _padded_batch(np.random.default_rng(0), [(33, "right"), (20, "left"), (27, "right")],
                                 config.vocab_size)

    ours = np.asarray(forward(params, config, jnp.asarray(tokens), jnp.asarray(mask)))
    ref = hf_logits(path, tokens, mask)

    real = mask.astype(bool)
    assert np.abs(ours - ref)[real].max() <= TOL
    assert np.isfinite(ours).all()  # pad positions too: they must not turn into NaN


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_long_prompt_matches_transformers(tmp_path, model_type):
    """520 tokens: RoPE at large positions with a non-default theta."""
    path = make_tiny_hf_checkpoint(tmp_path / "ckpt", model_type, rope_theta=1_000_000.0)
    config, params = load_hf(path)
    tokens = np.random.default_rng(1).integers(0, config.vocab_size, (1, 520)).astype(np.int32)

    ours = np.asarray(forward(params, config, jnp.asarray(tokens)))
    ref = hf_logits(path, tokens)

    assert ours.shape == ref.shape == (1, 520, config.vocab_size)
    assert ours.dtype == np.float32
    assert np.abs(ours - ref).max() <= TOL
