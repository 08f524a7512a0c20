"""What a checkpoint costs a training step: `Checkpointer.save` of a train state (params and
their Adam moments) of the main job's toy model, saved again and again as a run does.

Figures printed (medians over the saves after the first, which also starts the checkpoint
manager's threads): how long `save` holds the step (what a step waits for), and how long until
the checkpoint is written (`wait` returns). The main job checkpoints SFT every
`SFT_CHECKPOINT_EVERY` steps and RL every `RL_CHECKPOINT_EVERY` (rstar2_jax.toy.demo).

Usage: python experiments/benchmarks/bench_checkpoint.py [--saves 11] [--vocab 1024] [--dir DIR]
"""

import argparse
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import optax

from rstar2_jax.model import ModelConfig, init_params
from rstar2_jax.toy.demo import ToyModel
from rstar2_jax.train.checkpoint import Checkpointer
from rstar2_jax.train.configs import CheckpointConfig
from rstar2_jax.train.step import TrainState


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=11)
    parser.add_argument("--vocab", type=int, default=1024, help="the main job's tokenizer bound")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()

    shape = ToyModel()
    config = ModelConfig(model_type="qwen3", vocab_size=args.vocab, hidden_size=shape.hidden_size,
                         intermediate_size=shape.intermediate_size, num_layers=shape.num_layers,
                         num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
                         head_dim=shape.head_dim, qk_norm=True, tie_embeddings=True)
    params = init_params(config, jax.random.key(0))
    state = TrainState(params=params, opt_state=optax.adamw(1e-3).init(params), step=jnp.int32(0))
    print(f"train state: {sum(x.size for x in jax.tree.leaves(params)):,} params "
          f"+ Adam moments, {sum(x.nbytes for x in jax.tree.leaves(state)) / 2**20:.1f} MiB")
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        checkpointer = Checkpointer(directory, CheckpointConfig(every=1, keep=1))
        held, written = [], []
        for step in range(1, args.saves + 1):
            state = state._replace(step=jnp.int32(step))
            start = time.perf_counter()
            checkpointer.save(state, rng=jax.random.key(0), data_position={"step": step},
                              job_config={}, model_config=config)
            held.append(time.perf_counter() - start)
            checkpointer.wait()
            written.append(time.perf_counter() - start)
        checkpointer.close()
    print(f"first save: written in {written[0] * 1e3:.0f} ms")
    print(f"later saves (median of {len(held) - 1}): hold the step {statistics.median(held[1:]) * 1e3:.0f} ms, "
          f"written in {statistics.median(written[1:]) * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
