"""Devices by role: the trainer's and the sampler's, and the weights copied between them.

By default (``mesh.rollout_devices=0``) every device trains, and the sampler serves on the
trainer's devices: on one process it reads the trainer's params where they are; across
processes it reads a full copy on its host's first device (a sampler's programs cannot span
hosts that decode different numbers of steps).

With ``mesh.rollout_devices=n`` each process keeps its last n local devices for its sampler
(its *rollout mesh*, tensor-parallel over them) and the trainer's mesh spans the other devices
of every process. Sampling and training then run at the same time on disjoint devices
(``rl.max_staleness`` > 0), and after each update the trainer copies its params to the
sampler's devices, cast to the serving dtype (`ServingCopy`):

    trainer's params ──cast, all-gather within each host──▶ this host's training devices
    (sharded over every                                      (a full copy spread over them)
     process's devices)                   ──device to device──▶ this host's rollout mesh

The all-gather is a collective of the trainer's mesh, so it runs in the trainer's thread, in the
same order on every process; the sampler's programs run on its own devices only, and its
exchanges with other hosts go through the distributed runtime's key-value store
(`rstar2_jax.parallel.hosts`), so the two threads never contend for a device's collectives.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rstar2_jax.errors import ConfigError
from rstar2_jax.model import ModelConfig
from rstar2_jax.parallel.sharding import FSDP, TP, make_mesh, named_shardings, param_specs

HOSTS = "hosts"


def _by_process() -> dict[int, list]:
    """Every process's devices, in id order."""
    out: dict[int, list] = {}
    for device in sorted(jax.devices(), key=lambda d: d.id):
        out.setdefault(device.process_index, []).append(device)
    return out


def split_devices(rollout_devices: int) -> tuple[list, list]:
    """(the training devices of every process, host-major; this process's rollout devices):
    each process's last ``rollout_devices`` local devices serve its sampler. Raises ConfigError
    when that leaves a process no device to train on."""
    if rollout_devices < 0:
        raise ConfigError(f"mesh.rollout_devices must be >= 0, got {rollout_devices}")
    by_process = _by_process()
    least = min(len(devices) for devices in by_process.values())
    if rollout_devices >= least:
        raise ConfigError(f"mesh.rollout_devices={rollout_devices} leaves no device to train on: "
                          f"a process has {least} device(s)")
    train = [d for p in sorted(by_process) for d in by_process[p][:len(by_process[p]) - rollout_devices]]
    rollout = by_process[jax.process_index()][len(by_process[jax.process_index()]) - rollout_devices:]
    return train, rollout


def rollout_mesh(rollout_devices: int) -> Mesh | None:
    """The sampler's mesh: this process's rollout devices, tensor-parallel (``(fsdp, tp) =
    (1, n)``); without them, on several processes, this host's first device; None on one
    process without them (the sampler reads the trainer's params in place)."""
    _, devices = split_devices(rollout_devices)
    if not devices:
        if jax.process_count() == 1:
            return None
        devices = jax.local_devices()[:1]
    return make_mesh(fsdp=1, tp=len(devices), devices=devices)


@dataclasses.dataclass
class ServingCopy:
    """The trainer's params -> the sampler's copy: floating arrays cast to ``dtype``, placed on
    ``rollout`` (`rollout_mesh`), or, without one, laid out as the trainer's (a copy the train
    step cannot donate from under the sampler).

    Args:
      config: the model (for the partition specs).
      train: the trainer's mesh, where the params live.
      rollout: the sampler's mesh, or None.
      dtype: the serving dtype.
    """

    config: ModelConfig
    train: Mesh
    rollout: Mesh | None
    dtype: jnp.dtype

    def __post_init__(self):
        def cast(params):
            return jax.tree.map(lambda x: jnp.copy(x.astype(self.dtype) if jnp.issubdtype(
                x.dtype, jnp.floating) else x), params)

        if self.rollout is None:
            self._cast: Callable = jax.jit(cast)
            return
        # Each host's training devices as a mesh axis of its own: params sharded over it and
        # replicated over hosts are a full copy on every host, spread over its devices, which
        # costs each device 1 / (its host's training devices) of the params, not all of them.
        devices = sorted(self.train.devices.flat, key=lambda d: (d.process_index, d.id))
        hosts = len({d.process_index for d in devices})
        spread = Mesh(np.array(devices).reshape(hosts, -1, 1), (HOSTS, FSDP, TP))
        self._spread_specs = param_specs(self.config, spread)
        self._cast = jax.jit(cast, out_shardings=named_shardings(spread, self._spread_specs))
        mine = [d for d in devices if d.process_index == jax.process_index()]
        self._local = Mesh(np.array(mine).reshape(-1, 1), (FSDP, TP))
        self._serving = named_shardings(self.rollout, param_specs(self.config, self.rollout))
        self._trained = named_shardings(self.train, param_specs(self.config, self.train))

    def __call__(self, params):
        """The sampler's copy of ``params`` (ready: the caller may donate ``params`` next)."""
        copy = self._cast(params)
        if self.rollout is not None:
            if not jax.tree.leaves(copy)[0].is_fully_addressable:
                copy = jax.tree.map(self._host_part, self._spread_specs, copy,
                                    is_leaf=lambda s: isinstance(s, PartitionSpec))
            copy = jax.device_put(copy, self._serving)
        return jax.block_until_ready(copy)

    def as_params(self, copy):
        """``copy`` (one `__call__` made) laid out as the trainer's params, in its own dtype:
        arrays over every process's training devices, which a checkpoint saves as it saves the
        params (each host its shards) and `__call__` takes back to the sampler. Each host's
        shards come from its own copy; every host's copy holds the same values."""
        if self.rollout is None:
            return copy  # on the trainer's devices already
        return jax.tree.map(lambda x, sharding: jax.make_array_from_callback(
            x.shape, sharding, lambda index: x[index]), copy, self._trained)

    def _host_part(self, spec: PartitionSpec, x: jax.Array) -> jax.Array:
        """This host's full copy of ``x`` (spread over its training devices) as an array of its
        own devices, which a device-to-device copy can take to the rollout mesh."""
        return jax.make_array_from_single_device_arrays(
            x.shape, NamedSharding(self._local, spec), [s.data for s in x.addressable_shards])
