"""Causal attention forward + backward: the model's `attention` against jax.nn's kernels.

    python experiments/benchmarks/bench_attention.py            # 8 x 2048, 16 / 8 heads, d 128, bf16
    python experiments/benchmarks/bench_attention.py --batch 2 --seq 512 --dtype float32   # CPU

Times jit(grad) of a weighted sum of the output with respect to q, k and v (median of
``--repeats``), for:

    ours    rstar2_jax.model.transformer.attention, causal over row lengths (the training
            path): cuDNN's flash attention on an NVIDIA GPU in bfloat16, query chunks on other
            accelerators, all scores at once on CPU
    cudnn   jax.nn.dot_product_attention(implementation="cudnn"), where it runs (NVIDIA)
    xla     jax.nn.dot_product_attention(implementation="xla"): materialises [B, H, T, S] scores

and XLA's FLOP count of each compiled program. Target on an H100: ours within 1.2x of cudnn.
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from rstar2_jax.model import transformer


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()

    b, t, h, kv, d = args.batch, args.seq, args.heads, args.kv_heads, args.head_dim
    dtype = jnp.dtype(args.dtype)
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, t, h, d), dtype)
    k = jax.random.normal(keys[1], (b, kv, t, d), dtype)  # the model's [B, K, S, D] layout
    v = jax.random.normal(keys[2], (b, kv, t, d), dtype)
    weights = jax.random.normal(keys[3], (b, t, h, d), jnp.float32)
    lengths = jnp.full((b,), t, jnp.int32)
    precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None

    def jax_nn(implementation):
        return lambda q, k, v: jax.nn.dot_product_attention(
            q, k.swapaxes(1, 2), v.swapaxes(1, 2), is_causal=True, query_seq_lengths=lengths,
            key_value_seq_lengths=lengths, implementation=implementation)

    kernels = {"ours": lambda q, k, v: transformer.attention(q, k, v, lengths=lengths,
                                                              precision=precision),
               "cudnn": jax_nn("cudnn"), "xla": jax_nn("xla")}
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}")
    print(f"causal attention fwd+bwd, {b} x {t}, {h} / {kv} heads, head_dim {d}, {args.dtype}")
    times = {}
    for name, fn in kernels.items():
        step = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) * weights), argnums=(0, 1, 2)))
        try:
            compiled = step.lower(q, k, v).compile()
        except Exception as e:  # noqa: BLE001 - cudnn off NVIDIA, or a shape it does not take
            print(f"  {name:6s} not available here ({type(e).__name__}: {str(e).splitlines()[0][:100]})")
            continue
        jax.block_until_ready(compiled(q, k, v))
        samples = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            jax.block_until_ready(compiled(q, k, v))
            samples.append(time.perf_counter() - start)
        times[name] = statistics.median(samples)
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        print(f"  {name:6s} {times[name] * 1e3:9.2f} ms   XLA count {cost.get('flops', 0) / 1e9:9.1f} GFLOP")
    if "cudnn" in times:
        print(f"ours / cudnn: {times['ours'] / times['cudnn']:.2f}x (target <= 1.2x)")
    print(f"ours / xla: {times['ours'] / times['xla']:.2f}x")


if __name__ == "__main__":
    main()
