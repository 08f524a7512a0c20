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
3. That copy, laid out as the params (`ServingCopy.as_params`), is saved in a checkpoint (the
   directory: the first argument) as an asynchronous run's policy version, read back, and
   copied to the rollout device again: the same copy.
Prints one JSON line of what it saw."""
import json
import sys
import threading
from pathlib import Path

from rstar2_jax.parallel.distributed import initialize_from_env

initialize_from_env()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax._src.distributed import global_state  # noqa: E402

from rstar2_jax.parallel import hosts  # noqa: E402
from rstar2_jax.model import ModelConfig, init_params  # noqa: E402
from rstar2_jax.parallel.roles import ServingCopy, rollout_mesh, split_devices  # noqa: E402
from rstar2_jax.parallel.sharding import make_mesh, param_specs, shard_params  # noqa: E402
from rstar2_jax.train.checkpoint import Checkpointer  # noqa: E402
from rstar2_jax.train.configs import OptimizerConfig  # noqa: E402
from rstar2_jax.train.optim import make_optimizer  # noqa: E402
from rstar2_jax.train.step import init_train_state  # noqa: E402

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
params = jax.tree.map(np.asarray, init_params(config, jax.random.key(0)))  # as load_hf gives them
train_devices, rollout_devices = split_devices(1)
train = make_mesh(fsdp=2, tp=1, devices=train_devices)
sharded = shard_params(params, config, train)
serving = ServingCopy(config, train, rollout_mesh(1), jnp.bfloat16)
copy = serving(sharded)
leaves = jax.tree.leaves(copy)
same = all(np.array_equal(np.asarray(c), np.asarray(p.astype(jnp.bfloat16)))
           for c, p in zip(leaves, jax.tree.leaves(params), strict=True))

state = init_train_state(sharded, make_optimizer(OptimizerConfig(), 10), mesh=train,
                         param_specs=param_specs(config, train))
checkpoints = Checkpointer(Path(sys.argv[1]))
checkpoints.save(state, rng=jax.random.key(0), data_position=None, job_config={},
                 model_config=config, versions={1: serving.as_params(copy)})
checkpoints.wait()
again = serving(checkpoints.restore(0, state, read_versions=True).versions[1])
checkpoints.close()
print(json.dumps({
    "seen": seen, "left": left, "same": same, "delivered": delivered,
    "version_back": all(np.array_equal(np.asarray(a), np.asarray(b))
                        for a, b in zip(jax.tree.leaves(again), leaves, strict=True)),
    "version_devices": sorted({d.id for x in jax.tree.leaves(again) for d in x.devices()}),
    "dtypes": sorted({str(x.dtype) for x in leaves}),
    "devices": sorted({d.id for x in leaves for d in x.devices()}),
    "rollout": [d.id for d in rollout_devices],
    "train_sharded": not jax.tree.leaves(sharded)[0].is_fully_addressable}))
