"""RL train-step throughput (tokens/s) and the fraction of the machine's matmul rate it reaches.

    python experiments/benchmarks/bench_train_step.py [--batch 16] [--seq 512] [--repeats 3]

One step = forward + backward of the clipped policy loss (chunked log-probs) + AdamW, jitted,
on a ~30M-parameter Qwen3 (hidden 512, intermediate 2048, 8 layers, 8 heads, 4 kv heads,
head_dim 64, vocab 4096, tied embeddings) with random weights, fp32, on the default device (all
CPU cores). Model FLOPs per step = 6 * params * tokens (every weight does a multiply-add forward
and two backward) + attention: QK^T and AV are 2 * 2 * seq^2 * heads * head_dim per sequence
and layer forward, x3 with the backward (the model computes full, not causal-halved, scores).
The reference rate is the best of a few square float32 ``jnp.matmul``s in the same process.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from rstar2_jax.model import ModelConfig, init_params
from rstar2_jax.train.configs import OptimizerConfig, RLConfig
from rstar2_jax.train.optim import make_optimizer
from rstar2_jax.train.rl_update import rl_loss
from rstar2_jax.train.step import init_train_state, make_train_step

QWEN3_30M = ModelConfig(model_type="qwen3", vocab_size=4096, hidden_size=512, intermediate_size=2048,
                        num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64, qk_norm=True,
                        tie_embeddings=True, max_position_embeddings=4096)


def matmul_flops_per_s(sizes=(1024, 2048, 4096), repeats: int = 3) -> tuple[float, int]:
    """Best measured float32 matmul rate and the size that reached it."""
    best = (0.0, 0)
    for n in sizes:
        a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
        b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
        matmul = jax.jit(jnp.matmul)
        matmul(a, b).block_until_ready()
        seconds = min(_timed(lambda: matmul(a, b).block_until_ready()) for _ in range(repeats))
        best = max(best, (2 * n**3 / seconds, n))
    return best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def model_flops(config: ModelConfig, num_params: int, batch: int, seq: int) -> float:
    attention = 3 * 2 * 2 * seq**2 * config.num_heads * config.head_dim * config.num_layers * batch
    return 6 * num_params * batch * seq + attention


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--remat", action="store_true")
    args = parser.parse_args()

    config = QWEN3_30M
    params = init_params(config, jax.random.key(0))
    num_params = sum(x.size for x in jax.tree.leaves(params))
    optimizer = make_optimizer(OptimizerConfig(lr=1e-6), total_steps=100)
    loss = functools.partial(rl_loss, model_config=config, config=RLConfig(remat=args.remat))
    step = make_train_step(loss, optimizer, micro_batches=args.micro_batches)
    state = init_train_state(params, optimizer)

    rng = np.random.default_rng(0)
    b, t = args.batch, args.seq - 1
    batch = {"inputs": rng.integers(0, config.vocab_size, (b, t)).astype(np.int32),
             "targets": rng.integers(0, config.vocab_size, (b, t)).astype(np.int32),
             "attention_mask": np.ones((b, t), np.int32), "mask": np.ones((b, t), bool),
             "advantages": rng.normal(size=b).astype(np.float32),
             "old_logp": np.full((b, t), -np.log(config.vocab_size), np.float32)}
    batch = jax.device_put(batch)

    def run():
        nonlocal state
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)

    compile_seconds = _timed(run)
    seconds = statistics.median(_timed(run) for _ in range(args.repeats))
    tokens = b * args.seq
    flops = model_flops(config, num_params, b, args.seq)
    peak, peak_n = matmul_flops_per_s()
    print(f"device: {jax.devices()[0].device_kind} x{len(jax.devices())}, jax {jax.__version__}")
    print(f"model: {num_params / 1e6:.1f}M params, batch {b} x {args.seq}, "
          f"micro-batches {args.micro_batches}, remat {args.remat}")
    print(f"first step (compile + run): {compile_seconds:.1f} s")
    print(f"train step: {seconds:.3f} s median of {args.repeats} -> {tokens / seconds:,.0f} tokens/s")
    print(f"model FLOPs/step: {flops / 1e9:.1f} GFLOP -> {flops / seconds / 1e9:.1f} GFLOP/s")
    print(f"matmul reference: {peak / 1e9:.1f} GFLOP/s (float32 {peak_n}x{peak_n})")
    print(f"fraction of matmul rate: {flops / seconds / peak:.1%} (target >= 40%)")


if __name__ == "__main__":
    main()
