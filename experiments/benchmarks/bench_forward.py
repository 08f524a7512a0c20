"""Forward throughput (tokens/s) of rstar2_jax next to transformers (PyTorch CPU) on the same weights.

    python experiments/benchmarks/bench_forward.py [--batch 16] [--seq 512] [--repeats 3]

A ~30M-parameter Qwen3 (hidden 512, intermediate 2048, 8 layers, 8 heads, 4 kv heads, head_dim
64, vocab 4096, tied embeddings) with random weights is written as a transformers checkpoint and
loaded with `load_hf`, so both sides compute the same function. Each side runs one untimed
warm-up (JAX compiles there), then `--repeats` timed full causal forwards; the median is reported.
Both use fp32 and all CPU cores. Needs torch, which is a test dependency, not a runtime one.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from rstar2_jax.model import forward, load_hf

QWEN3_30M = dict(vocab_size=4096, hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=64, tie_word_embeddings=True,
                 max_position_embeddings=4096)


def _median_seconds(run, repeats: int) -> float:
    run()  # warm-up: compilation (JAX) and allocator/thread-pool start-up (both)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(**QWEN3_30M),
                                                             dtype=torch.float32).eval()
    with tempfile.TemporaryDirectory() as tmp:
        hf_model.save_pretrained(tmp)
        config, params = load_hf(tmp)
    num_params = sum(x.size for x in jax.tree.leaves(params))
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (args.batch, args.seq)).astype(np.int32)
    jax_tokens, torch_tokens = jnp.asarray(tokens), torch.as_tensor(tokens, dtype=torch.int64)

    jax_seconds = _median_seconds(lambda: forward(params, config, jax_tokens).block_until_ready(),
                                  args.repeats)
    with torch.no_grad():
        torch_seconds = _median_seconds(lambda: hf_model(input_ids=torch_tokens), args.repeats)
        torch_logits = hf_model(input_ids=torch_tokens).logits.numpy()
    max_diff = np.abs(np.asarray(forward(params, config, jax_tokens)) - torch_logits).max()

    n_tokens = args.batch * args.seq
    print(f"Qwen3 {num_params / 1e6:.1f}M params, batch {args.batch} x {args.seq} tokens, fp32, "
          f"{jax.device_count()} JAX device(s) ({jax.devices()[0].platform}), "
          f"torch {torch.get_num_threads()} threads, median of {args.repeats}")
    print(f"{'implementation':<28}{'seconds':>10}{'tokens/s':>12}")
    print(f"{'rstar2_jax forward (jit)':<28}{jax_seconds:>10.3f}{n_tokens / jax_seconds:>12.0f}")
    print(f"{'transformers ' + transformers.__version__:<28}{torch_seconds:>10.3f}"
          f"{n_tokens / torch_seconds:>12.0f}")
    print(f"max |logit difference| between the two: {max_diff:.2e}")


if __name__ == "__main__":
    main()
