"""One process of the 2-process exchange and weight-copy test (tests/test_multiprocess.py),
started with the JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID variables and 2
CPU devices: one trains, one serves rollouts (``mesh.rollout_devices=1``).

1. Two threads exchange at once on two channels, in opposite orders on the two processes (as a
   sampler thread and the trainer do): every exchange pairs with the same channel's on the
   other process, and a channel's exchange two back is deleted from the key-value store.
2. The trainer's params, sharded over both processes' training devices, are copied to this
   process's rollout device by `ServingCopy`: a whole copy, in the serving dtype, on that
   device alone.
Prints one JSON line of what it saw."""
import json
import threading

from rstar2_jax.distributed import initialize_from_env

initialize_from_env()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax._src.distributed import global_state  # noqa: E402

from rstar2_jax import hosts  # noqa: E402
from rstar2_jax.model import ModelConfig, init_params  # noqa: E402
from rstar2_jax.roles import ServingCopy, rollout_mesh, split_devices  # noqa: E402
from rstar2_jax.sharding import make_mesh, shard_params  # noqa: E402

me = jax.process_index()
seen = {}


def exchanges(channel: str, rounds: int):
    # Sizes differ by process and round: each round's parts must come from the same round.
    seen[channel] = [hosts.gather({"x": np.full((me + 1, 2), 10 * r + me, np.int32)}, channel)["x"].tolist()
                     for r in range(rounds)]


order = ["rollout", "train"] if me == 0 else ["train", "rollout"]
threads = [threading.Thread(target=exchanges, args=(channel, 3)) for channel in order]
for t in threads:
    t.start()
for t in threads:
    t.join()
# Two rounds back is deleted by the process that wrote it (round 0 after round 2), round 1 stays.
client = global_state.client
hosts.gather_objects("done", "rollout")  # both processes have finished round 2 of each channel
left = sorted({key.split("/")[3] for key, _ in client.key_value_dir_get_bytes("rstar2_jax/exchange/train/")})

config = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True,
                     tie_embeddings=True)
params = init_params(config, jax.random.key(0))
train_devices, rollout_devices = split_devices(1)
train = make_mesh(fsdp=2, tp=1, devices=train_devices)
sharded = shard_params(params, config, train)
copy = ServingCopy(config, train, rollout_mesh(1), jnp.bfloat16)(sharded)
leaves = jax.tree.leaves(copy)
same = all(np.array_equal(np.asarray(c), np.asarray(p.astype(jnp.bfloat16)))
           for c, p in zip(leaves, jax.tree.leaves(params), strict=True))
print(json.dumps({
    "seen": seen, "left": left, "same": same,
    "dtypes": sorted({str(x.dtype) for x in leaves}),
    "devices": sorted({d.id for x in leaves for d in x.devices()}),
    "rollout": [d.id for d in rollout_devices],
    "train_sharded": not jax.tree.leaves(sharded)[0].is_fully_addressable}))
