"""Work split across JAX processes (hosts): which share each host samples, what the hosts tell
each other, and the params a host's sampler reads.

An RL step or an evaluation splits its questions into contiguous blocks, one per process
(`share`). Each host samples its block with its own sampler, sandbox and verifier pools, so a
tool call never leaves the host that made it. Sampling keys are indexed by a rollout's position
in the whole step (`AgentSampler.rollout`'s ``first_sequence``), so a rollout draws the same
tokens whichever host runs it, and the result does not depend on the process count.

The hosts then exchange only small summaries (`gather`: the ``[questions, n]`` arrays an RL
algorithm selects on, a few kilobytes; `gather_objects`: an evaluation's per-sample records). A
host that finished early waits in that exchange, a blocking collective rather than a busy loop;
if another host died, the distributed runtime's heartbeat timeout stops it
(`rstar2_jax.distributed`).

On one process every function here is the identity (or the whole range).
"""
from __future__ import annotations

import json

import jax
import numpy as np
from jax.experimental import multihost_utils


def share(count: int) -> slice:
    """This process's block of ``count`` items: block `jax.process_index()` of
    `jax.process_count()` contiguous blocks whose sizes differ by at most one (the first ones
    larger)."""
    processes, index = jax.process_count(), jax.process_index()
    base, extra = divmod(count, processes)
    start = index * base + min(index, extra)
    return slice(start, start + base + (index < extra))


def gather(tree):
    """Every process's host arrays (the same structure and shapes on each), concatenated on
    their first axis in process order."""
    if jax.process_count() == 1:
        return tree
    return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))


def gather_objects(value) -> list:
    """Every process's JSON-serialisable ``value``, in process order."""
    if jax.process_count() == 1:
        return [value]
    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    sizes = gather(np.array([data.size]))
    padded = np.zeros((int(sizes.max()),), np.uint8)
    padded[:data.size] = data
    rows = np.asarray(multihost_utils.process_allgather(padded, tiled=False))
    return [json.loads(row[:size].tobytes()) for row, size in zip(rows, sizes)]


def serving_params(params):
    """The params this process's sampler reads: the trainer's own on one process; a full copy
    on this host's first device when the trainer's are split across processes (a sampler on
    one host cannot read another host's shards)."""
    if jax.process_count() == 1:
        return params
    full = multihost_utils.process_allgather(params, tiled=True)
    return jax.device_put(full, jax.local_devices()[0])
