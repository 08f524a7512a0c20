"""Scale plan: compile the RL train step for a real model size and mesh without any weights.

    python -m rstar2_jax scale-plan model=qwen3-14b devices=64 tp=1 seq_len=14336

Params and optimizer state are abstract (``jax.eval_shape``), the devices are fake CPU devices
(``--xla_force_host_platform_device_count``, set in a child process because it must precede
JAX's start), and the full sharded step (forward, backward, AdamW) is lowered and compiled.
Reported per device: the params and optimizer state (exact, from the shard shapes) and the
compiler's temporary buffers, i.e. activations and gradients (from ``memory_analysis()`` of the
CPU compilation; an accelerator backend's buffer assignment differs somewhat, so treat it as an
estimate).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Literal

from rstar2_jax.model import ModelConfig

_QWEN3 = dict(model_type="qwen3", vocab_size=151936, qk_norm=True, rope_theta=1_000_000.0,
              max_position_embeddings=40960, dtype="bfloat16")
PRESETS = {
    "qwen3-14b": ModelConfig(**_QWEN3, hidden_size=5120, intermediate_size=17408, num_layers=40,
                             num_heads=40, num_kv_heads=8, head_dim=128),
    "qwen3-8b": ModelConfig(**_QWEN3, hidden_size=4096, intermediate_size=12288, num_layers=36,
                            num_heads=32, num_kv_heads=8, head_dim=128),
    "qwen3-1.7b": ModelConfig(**_QWEN3 | {"vocab_size": 151936}, hidden_size=2048,
                              intermediate_size=6144, num_layers=28, num_heads=16,
                              num_kv_heads=8, head_dim=128, tie_embeddings=True),
    "qwen3-0.6b": ModelConfig(**_QWEN3, hidden_size=1024, intermediate_size=3072, num_layers=28,
                              num_heads=16, num_kv_heads=8, head_dim=128, tie_embeddings=True),
}


@dataclass(frozen=True)
class ScalePlanConfig:
    """One micro-batch of ``rows_per_device * fsdp`` rollouts of ``seq_len`` tokens per
    forward/backward (the paper: prompts up to 2K + responses up to 12K tokens), computed in
    bfloat16 with master weights and AdamW moments in ``params`` (the training default,
    float32; see `rstar2_jax.train.configs.PrecisionConfig`)."""

    model: Literal["qwen3-14b", "qwen3-8b", "qwen3-1.7b", "qwen3-0.6b"] = "qwen3-14b"
    devices: int = 64
    tp: int = 1
    rows_per_device: int = 1
    seq_len: int = 14336
    remat: bool = True
    logprob_chunk: int = 256
    params: Literal["float32", "bfloat16"] = "float32"

    def __post_init__(self):
        if self.devices < 1 or self.tp < 1 or self.devices % self.tp:
            raise ValueError(f"tp={self.tp} must divide devices={self.devices}")
        if self.rows_per_device < 1 or self.seq_len < 2:
            raise ValueError("rows_per_device must be >= 1 and seq_len >= 2")


def _tree_bytes(tree) -> tuple[int, int]:
    """(total bytes, bytes on the most loaded device) of an abstract sharded pytree."""
    import jax

    total = per_device = 0
    for x in jax.tree.leaves(tree):
        itemsize = x.dtype.itemsize
        total += math.prod(x.shape) * itemsize
        per_device += math.prod(x.sharding.shard_shape(x.shape)) * itemsize
    return total, per_device


def plan(config: ScalePlanConfig) -> dict:
    """Compiles the sharded RL train step; needs ``config.devices`` devices in this process."""
    import jax
    import jax.numpy as jnp

    from rstar2_jax.model import init_params
    from rstar2_jax.parallel.sharding import batch_spec, make_mesh, param_specs
    from rstar2_jax.train.configs import OptimizerConfig, RLConfig
    from rstar2_jax.train.optim import make_optimizer
    from rstar2_jax.train.rl_update import rl_loss
    from rstar2_jax.train.step import TrainState, make_train_step, state_shardings

    model = PRESETS[config.model]
    mesh = make_mesh(config.devices // config.tp, config.tp, devices=jax.devices()[:config.devices])
    specs = param_specs(model, mesh)
    optimizer = make_optimizer(OptimizerConfig(), total_steps=100)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.dtype(config.params)),
                          jax.eval_shape(functools.partial(init_params, model), jax.random.key(0)))
    shardings = state_shardings(optimizer, params, mesh, specs)
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            TrainState(params, jax.eval_shape(optimizer.init, params),
                                       jax.ShapeDtypeStruct((), jnp.int32)), shardings)
    rows, seq = config.rows_per_device * mesh.shape["fsdp"], config.seq_len - 1
    data = jax.sharding.NamedSharding(mesh, batch_spec())

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=data)

    batch = {"inputs": spec((rows, seq), jnp.int32), "targets": spec((rows, seq), jnp.int32),
             "attention_mask": spec((rows, seq), jnp.int32), "mask": spec((rows, seq), jnp.bool_),
             "advantages": spec((rows,), jnp.float32), "old_logp": spec((rows, seq), jnp.float32)}
    rl = RLConfig(remat=config.remat, logprob_chunk=config.logprob_chunk)
    loss = functools.partial(rl_loss, model_config=model, config=rl)
    step = make_train_step(loss, optimizer, mesh=mesh, param_specs=specs, params=params)
    compiled = step.lower(abstract, batch).compile()
    memory = compiled.memory_analysis()
    params_total, params_dev = _tree_bytes(abstract.params)
    opt_total, opt_dev = _tree_bytes(abstract.opt_state)
    return {
        "config": dataclasses.asdict(config),
        "mesh": dict(mesh.shape),
        "num_params": sum(math.prod(x.shape) for x in jax.tree.leaves(params)),
        "params_bytes_total": params_total, "params_bytes_per_device": params_dev,
        "opt_state_bytes_total": opt_total, "opt_state_bytes_per_device": opt_dev,
        "temp_bytes_per_device": memory.temp_size_in_bytes,
        "argument_bytes_per_device": memory.argument_size_in_bytes,
        "output_bytes_per_device": memory.output_size_in_bytes,
        "tokens_per_micro_batch": rows * config.seq_len,
    }


def run_in_subprocess(config: ScalePlanConfig) -> dict:
    """Runs :func:`plan` in a child process with ``config.devices`` fake CPU devices."""
    env = os.environ | {"JAX_PLATFORMS": "cpu",
                        "XLA_FLAGS": f"--xla_force_host_platform_device_count={config.devices}"}
    args = [f"{k}={v}" for k, v in dataclasses.asdict(config).items()]
    proc = subprocess.run([sys.executable, "-m", "rstar2_jax.train.scale_plan", *args], env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"scale plan failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def format_plan(result: dict) -> str:
    gib = 2**30
    c = result["config"]
    lines = [
        f"{c['model']}: {result['num_params'] / 1e9:.2f}B params on {c['devices']} devices, "
        f"mesh {result['mesh']}, {result['tokens_per_micro_batch']} tokens per micro-batch "
        f"({c['rows_per_device']} x {c['seq_len']} per fsdp rank), remat={c['remat']}",
        f"  params     {result['params_bytes_per_device'] / gib:8.2f} GiB/device "
        f"({result['params_bytes_total'] / gib:.1f} GiB total, {c['params']})",
        f"  opt state  {result['opt_state_bytes_per_device'] / gib:8.2f} GiB/device "
        f"({result['opt_state_bytes_total'] / gib:.1f} GiB total, AdamW moments in {c['params']})",
        f"  temporary  {result['temp_bytes_per_device'] / gib:8.2f} GiB/device "
        "(activations, gradients, all-gathered weights; XLA CPU buffer assignment)",
        f"  peak est.  {(result['params_bytes_per_device'] + result['opt_state_bytes_per_device'] + result['temp_bytes_per_device']) / gib:8.2f} GiB/device",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    from rstar2_jax.config import load_config

    print(json.dumps(plan(load_config(ScalePlanConfig, overrides=sys.argv[1:]))))
