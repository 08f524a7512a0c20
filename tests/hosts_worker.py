"""One process of the 2-process exchange and weight-copy test (tests/test_multiprocess.py),
started with the JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID variables and 2
CPU devices: one trains, one serves rollouts (``mesh.rollout_devices=1``).

1. Two threads exchange at once on two channels, in opposite orders on the two processes (as a
   sampler thread and the trainer do): every exchange pairs with the same channel's on the
   other process, and once every process is past a message its keys are deleted from the
   key-value store. Items delivered go to the processes that want them.
2. The trainer's params, sharded over both processes' training devices, are copied to this
   process's rollout device by `ServingCopy`: a whole copy, in the serving dtype, on that
   device alone.
Prints one JSON line of what it saw."""
import json
import threading

from rstar2_jax.parallel.distributed import initialize_from_env

initialize_from_env()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax._src.distributed import global_state  # noqa: E402

from rstar2_jax.parallel import hosts  # noqa: E402
from rstar2_jax.model import ModelConfig, init_params  # noqa: E402
from rstar2_jax.parallel.roles import ServingCopy, rollout_mesh, split_devices  # noqa: E402
from rstar2_jax.parallel.sharding import make_mesh, shard_params  # noqa: E402

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
client = global_state.client
# Items 0 and 2 are process 0's, item 1 process 1's; each process wants others' and its own.
wanted = [1, 2] if me == 0 else [0, 2]
delivered = hosts.deliver({0: "a", 2: ["c"]} if me == 0 else {1: {"b": 1}}, wanted, "rollout")
# Rollout messages 4 and 5: after 5 every process has finished message 4, and so deleted its
# keys of messages 0-3, the deliveries included.
hosts.gather_objects("done", "rollout")
hosts.gather_objects("done again", "rollout")
# A process deletes its keys of a channel's messages once an exchange shows every process past
# them: of the train channel's rounds 0-2 only round 2 stays.
left = {channel: sorted({key.split("/")[2] for key, _ in client.key_value_dir_get_bytes(f"rstar2_jax/{channel}/")})
        for channel in ("train", "rollout")}

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
    "seen": seen, "left": left, "same": same, "delivered": delivered,
    "dtypes": sorted({str(x.dtype) for x in leaves}),
    "devices": sorted({d.id for x in leaves for d in x.devices()}),
    "rollout": [d.id for d in rollout_devices],
    "train_sharded": not jax.tree.leaves(sharded)[0].is_fully_addressable}))
