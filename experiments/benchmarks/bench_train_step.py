"""RL train step: tokens/s, MFU against the device's peak, and XLA's count of the step's FLOPs.

    python experiments/benchmarks/bench_train_step.py                       # 30M Qwen3, 16 x 512
    python experiments/benchmarks/bench_train_step.py --model qwen3-0.6b --batch 8 --seq 2048 \\
        --compute bfloat16 --params float32                                 # the H100 target
    python experiments/benchmarks/bench_train_step.py --model qwen3-0.6b --batch 8 --seq 2048 \\
        --compute bfloat16 --cost-only                                      # any machine, no weights

One step = forward + backward of the clipped policy loss through chunked log-probs + AdamW,
jitted, random weights, on the default device, under a precision policy (``--params``,
``--compute``, ``--matmul``: `rstar2_jax.train.configs.PrecisionConfig`).

Model FLOPs per step = 6 x matmul params x tokens (a multiply-add per weight forward, two
backward; the embedding table counts only when it is also the output head) + causal attention:
QK^T and AV are 2 x 2 x seq^2 x heads x head_dim per sequence and layer forward, halved by the
causal mask, x3 with the backward. MFU is model FLOPs / step time / the device's peak in the
compute dtype: a table of datasheet peaks (dense) for NVIDIA, AMD and TPU chips; on CPU the best
measured square matmul rate in the compute dtype.

XLA's cost analysis of the compiled step (abstract inputs: nothing is allocated, so
``--cost-only`` works for any model on any machine) is printed next to the model FLOPs: what the
step computes beyond them (recomputation, full rather than causal attention scores, ...) shows
before any accelerator run. XLA counts a while loop's body once, so the counted program is the
same step with its loops unrolled, at 1 and 2 layers, extrapolated to the model's depth (exact:
the layers are identical).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from rstar2_jax.algorithms import GRPO_ROC
from rstar2_jax.model import ModelConfig, param_shapes
from rstar2_jax.model.params import init_params
from rstar2_jax.train.configs import OptimizerConfig, PrecisionConfig, RLConfig
from rstar2_jax.train.optim import make_optimizer
from rstar2_jax.rl.update import rl_loss
from rstar2_jax.rl.scale_plan import PRESETS
from rstar2_jax.train.step import TrainState, make_train_step

MODELS = {
    "qwen3-0.6b": PRESETS["qwen3-0.6b"],
    "qwen3-30m": ModelConfig(model_type="qwen3", vocab_size=4096, hidden_size=512,
                             intermediate_size=2048, num_layers=8, num_heads=8, num_kv_heads=4,
                             head_dim=64, qk_norm=True, tie_embeddings=True,
                             max_position_embeddings=4096),
    "toy": ModelConfig(model_type="qwen3", vocab_size=512, hidden_size=64, intermediate_size=192,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True,
                       tie_embeddings=True, max_position_embeddings=1024),
}

# Dense peak FLOP/s per chip from the vendors' datasheets (no sparsity), by a substring of
# jax's device_kind. float32 is what a "highest"-precision matmul runs at: the CUDA / matrix
# cores' FP32 rate on GPUs, a sixth of the bfloat16 rate on TPUs (six bfloat16 passes).
PEAKS = {
    "H100 PCIe": {"bfloat16": 756e12, "float32": 51.2e12},
    "H100": {"bfloat16": 989e12, "float32": 66.9e12},  # SXM ("NVIDIA H100 80GB HBM3")
    "H200": {"bfloat16": 989e12, "float32": 66.9e12},
    "A100": {"bfloat16": 312e12, "float32": 19.5e12},
    "MI300X": {"bfloat16": 1307e12, "float32": 163.4e12},
    "MI250X": {"bfloat16": 383e12, "float32": 95.7e12},
    "TPU v4": {"bfloat16": 275e12, "float32": 275e12 / 6},
    "TPU v5 lite": {"bfloat16": 197e12, "float32": 197e12 / 6},  # v5e
    "TPU v5": {"bfloat16": 459e12, "float32": 459e12 / 6},  # v5p
    "TPU v6 lite": {"bfloat16": 918e12, "float32": 918e12 / 6},  # v6e
}


def device_peak(dtype: str) -> tuple[float | None, str]:
    """The datasheet peak of this device in ``dtype`` and its name, or (None, kind)."""
    kind = jax.devices()[0].device_kind
    for name, peaks in PEAKS.items():
        if name in kind:
            return peaks[dtype], f"{name} datasheet"
    return None, kind


def measured_matmul_rate(dtype, sizes=(1024, 2048), repeats: int = 3) -> tuple[float, int]:
    """Best measured square matmul FLOP/s in ``dtype`` and the size that reached it."""
    best = (0.0, 0)
    for n in sizes:
        a = jax.random.normal(jax.random.key(0), (n, n), dtype)
        b = jax.random.normal(jax.random.key(1), (n, n), dtype)
        matmul = jax.jit(functools.partial(jnp.matmul, preferred_element_type=jnp.float32))
        matmul(a, b).block_until_ready()
        seconds = min(_timed(lambda: matmul(a, b).block_until_ready()) for _ in range(repeats))
        best = max(best, (2 * n**3 / seconds, n))
    return best


def _flop(x: float) -> str:
    return f"{x / 1e12:.3f} TFLOP" if x >= 1e12 else f"{x / 1e9:.2f} GFLOP"


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def matmul_params(config: ModelConfig) -> int:
    """Params that multiply activations: all but the input embedding table, unless it is tied
    to the output head (RMSNorm scales and biases are counted; they are a rounding error)."""
    shapes = jax.tree.leaves(param_shapes(config), is_leaf=lambda x: isinstance(x, tuple))
    total = sum(int(np.prod(s)) for s in shapes)
    return total if config.tie_embeddings else total - config.vocab_size * config.hidden_size


def model_flops(config: ModelConfig, batch: int, seq: int) -> tuple[float, float]:
    """(6 x matmul params x tokens, causal attention) FLOPs of one train step."""
    attention = 3 * 2 * 2 * seq**2 * config.num_heads * config.head_dim * config.num_layers * batch / 2
    return 6 * matmul_params(config) * batch * seq, attention


def _abstract_inputs(config: ModelConfig, optimizer, params_dtype, batch: int, seq: int):
    params = jax.eval_shape(functools.partial(init_params, config), jax.random.key(0))
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, params_dtype), params)
    state = TrainState(params, jax.eval_shape(optimizer.init, params),
                       jax.ShapeDtypeStruct((), jnp.int32))
    t = seq - 1
    spec = jax.ShapeDtypeStruct
    data = {"inputs": spec((batch, t), jnp.int32), "targets": spec((batch, t), jnp.int32),
            "attention_mask": spec((batch, t), jnp.int32), "mask": spec((batch, t), jnp.bool_),
            "advantages": spec((batch,), jnp.float32), "old_logp": spec((batch, t), jnp.float32)}
    return state, data


@contextlib.contextmanager
def _unrolled_loops():
    """jax.lax.scan and jax.lax.map unrolled while a program is traced (for XLA's cost analysis,
    which counts a loop's body once)."""
    scan, lax_map = jax.lax.scan, jax.lax.map

    def unrolled_scan(f, init, xs=None, length=None, **kwargs):
        return scan(f, init, xs, length, **(kwargs | {"unroll": True}))

    def unrolled_map(f, xs, **_):
        return unrolled_scan(lambda carry, x: (carry, f(x)), (), xs)[1]

    jax.lax.scan, jax.lax.map = unrolled_scan, unrolled_map
    try:
        yield
    finally:
        jax.lax.scan, jax.lax.map = scan, lax_map


def random_batch(config: ModelConfig, rows: int, seq: int) -> dict:
    """An RL update batch of random tokens on the default device: [rows, seq - 1] inputs and
    targets, every token trained, random advantages, uniform old log-probs."""
    rng, t = np.random.default_rng(0), seq - 1
    return jax.device_put({
        "inputs": rng.integers(0, config.vocab_size, (rows, t)).astype(np.int32),
        "targets": rng.integers(0, config.vocab_size, (rows, t)).astype(np.int32),
        "attention_mask": np.ones((rows, t), np.int32), "mask": np.ones((rows, t), bool),
        "advantages": rng.normal(size=rows).astype(np.float32),
        "old_logp": np.full((rows, t), -np.log(config.vocab_size), np.float32)})


# A timing does not depend on the learning rate.
OPTIMIZER = make_optimizer(OptimizerConfig(lr=1e-6), total_steps=100)


def rl_step(model_config: ModelConfig, policy: PrecisionConfig, rl: RLConfig,
            micro_batches: int = 1):
    """The jitted RL train step the benchmarks time (`rl_loss` at ``policy``'s compute dtype,
    AdamW `OPTIMIZER`); it donates its state."""
    loss = functools.partial(rl_loss, model_config=policy.compute_config(model_config), config=rl,
                             loss=GRPO_ROC.loss)
    return make_train_step(loss, OPTIMIZER, micro_batches=micro_batches)


def time_steps(step, state: TrainState, batch: dict, repeats: int) -> tuple[float, float]:
    """(seconds of the first step: compile + run, median seconds of ``repeats`` more)."""
    def run():
        nonlocal state
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)

    first = _timed(run)
    return first, statistics.median(_timed(run) for _ in range(repeats))


def xla_cost(make_step, config: ModelConfig, optimizer, params_dtype, batch: int, seq: int,
             abstract_inputs=None) -> dict:
    """XLA's flops and bytes accessed of one compiled step at the model's depth; its inputs
    `_abstract_inputs` of batch x seq rows, or ``abstract_inputs(config)`` if given."""
    def cost(layers):
        shallow = dataclasses.replace(config, num_layers=layers)
        with _unrolled_loops():
            step = make_step(shallow)
            inputs = (_abstract_inputs(shallow, optimizer, params_dtype, batch, seq)
                      if abstract_inputs is None else abstract_inputs(shallow))
            lowered = step.lower(*inputs)
        analysis = lowered.compile().cost_analysis()
        analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
        return np.array([analysis["flops"], analysis["bytes accessed"]])

    one, two = cost(1), cost(2)
    flops, bytes_accessed = one + (config.num_layers - 1) * (two - one)
    return {"flops": flops, "bytes": bytes_accessed}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen3-30m")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--params", choices=["float32", "bfloat16"], default="float32",
                        help="params and AdamW moments (master weights)")
    parser.add_argument("--compute", choices=["auto", "float32", "bfloat16"], default="auto",
                        help="forward/backward dtype (auto: bfloat16 on GPU/TPU, float32 on CPU)")
    parser.add_argument("--matmul", choices=["highest", "high", "default"], default="highest",
                        help="precision of float32 matmuls")
    parser.add_argument("--remat", action="store_true")
    parser.add_argument("--logprob-chunk", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cost-only", action="store_true",
                        help="only XLA's cost analysis (abstract inputs: nothing allocated)")
    args = parser.parse_args()

    policy = PrecisionConfig(params=args.params, compute=args.compute, matmul=args.matmul)
    config = dataclasses.replace(MODELS[args.model], dtype=args.params)
    rl = RLConfig(remat=args.remat, logprob_chunk=args.logprob_chunk)

    make_step = functools.partial(rl_step, policy=policy, rl=rl, micro_batches=args.micro_batches)

    b, seq = args.batch, args.seq
    dense, attention = model_flops(config, b, seq)
    flops = dense + attention
    print(f"device: {jax.devices()[0].device_kind} x{len(jax.devices())} ({jax.default_backend()}), "
          f"jax {jax.__version__}")
    print(f"model: {args.model}, {matmul_params(config) / 1e6:.1f}M matmul params, batch {b} x {seq}, "
          f"micro-batches {args.micro_batches}, remat {args.remat}; params {policy.params}, "
          f"compute {policy.compute_dtype}, float32 matmuls {policy.matmul}")
    print(f"model FLOPs/step: {_flop(flops)} (6 x params x tokens {_flop(dense)} "
          f"+ causal attention {_flop(attention)})")
    cost = xla_cost(make_step, config, OPTIMIZER, jnp.dtype(args.params), b, seq)
    print(f"XLA cost analysis: {_flop(cost['flops'])} ({cost['flops'] / flops:.2f}x the "
          f"model FLOPs), {cost['bytes'] / 1e9:.1f} GB accessed"
          + (" (XLA:GPU leaves out the cuBLAS and cuDNN calls: the matmuls and attention)"
             if jax.default_backend() == "gpu" else ""))
    if args.cost_only:
        return

    params = jax.tree.map(lambda x: x.astype(args.params), init_params(config, jax.random.key(0)))
    state = TrainState(params, OPTIMIZER.init(params), jnp.zeros((), jnp.int32))
    step = make_step(config)
    batch = random_batch(config, b, seq)

    compile_seconds, seconds = time_steps(step, state, batch, args.repeats)
    print(f"first step (compile + run): {compile_seconds:.1f} s")
    print(f"train step: {seconds:.3f} s median of {args.repeats} -> {b * seq / seconds:,.0f} "
          f"tokens/s, {_flop(flops / seconds)}/s")
    compute = policy.compute_dtype
    peak, source = device_peak(compute)
    if peak is None:
        peak, n = measured_matmul_rate(jnp.dtype(compute))
        source = f"measured {compute} {n}x{n} matmul"
        if compute != "float32":
            f32, n32 = measured_matmul_rate(jnp.float32)
            print(f"float32 matmul reference: {f32 / 1e9:.1f} GFLOP/s ({n32}x{n32}): "
                  f"{flops / seconds / f32:.1%} of it")
    print(f"peak: {peak / 1e12:.3f} TFLOP/s ({source}) -> MFU {flops / seconds / peak:.1%}")


if __name__ == "__main__":
    main()
