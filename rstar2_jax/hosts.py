"""Work split across JAX processes (hosts): which questions each host samples, what the hosts
tell each other, and the params a host's sampler reads.

An RL step's or an evaluation's questions are a shared queue (`claims`): each host takes the
next question as a row of its engine frees up, so a host whose questions finish early takes more
of them and the step does not wait for the host that drew the longest ones. An RL step's update
still trains each host on a contiguous block of the questions (`share`). Each host samples with its own sampler,
sandbox and verifier pools, so a tool call never leaves the host that made it. Sampling keys are
indexed by a rollout's position in the whole step (`AgentSampler.rollout`'s
``first_sequence``), so a rollout draws the same tokens whichever host runs it, and the result
depends neither on the process count nor on which host took which question.

The hosts then exchange what they sampled (`gather_questions`: an RL step's trajectories, in
question order; `gather`: small arrays; `gather_objects`: an evaluation's per-sample records). A
host that finished early waits in that exchange, a blocking collective rather than a busy loop;
if another host died, the distributed runtime's heartbeat timeout stops it
(`rstar2_jax.distributed`).

On one process every function here is the identity (or the whole range, in order).
"""
from __future__ import annotations

import itertools
import json
from typing import Callable

import jax
import numpy as np
from jax.experimental import multihost_utils

from rstar2_jax.sampler.feeder import in_order


def share(count: int) -> slice:
    """This process's block of ``count`` items: block `jax.process_index()` of
    `jax.process_count()` contiguous blocks whose sizes differ by at most one (the first ones
    larger)."""
    processes, index = jax.process_count(), jax.process_index()
    base, extra = divmod(count, processes)
    start = index * base + min(index, extra)
    return slice(start, start + base + (index < extra))


_queues = itertools.count()  # the queues this process has made: the next one's name


def claims(count: int) -> Callable[[], int | None]:
    """A queue of ``count`` items shared by the run's processes: each call hands this process
    the next item no process has taken, ``0 .. count - 1`` in turn, then None. Every process
    makes the same sequence of queues (the k-th `claims` call of each process shares the k-th
    queue, as collectives pair up). On one process: the items in order.

    The queue is a counter in the key-value store of JAX's distributed runtime (process 0's
    coordination service), taken with an atomic increment: one round trip, about 0.35 ms on
    localhost. A process that dies stops the others (`rstar2_jax.distributed`).
    """
    if jax.process_count() == 1:
        return in_order(count)
    # The runtime's client is not public API in JAX 0.10.2 (orbax and JAX's own checkpointing
    # use it the same way).
    from jax._src.distributed import global_state

    client, key = global_state.client, f"rstar2_jax/claims/{next(_queues)}"

    def claim() -> int | None:
        taken = client.key_value_increment(key, 1) - 1  # the counter's value after this claim
        return taken if taken < count else None

    return claim


def gather_questions(count: int, mine: dict[int, object]) -> list:
    """Every process's JSON-serialisable values of the questions it ran (``mine``: question
    index -> value), in question order ``0 .. count - 1``. Raises RuntimeError unless the
    processes ran every question exactly once between them."""
    ran = [pair for values in gather_objects(sorted(mine.items())) for pair in values]
    questions = sorted(q for q, _ in ran)
    if questions != list(range(count)):
        raise RuntimeError(f"the processes ran questions {questions} between them, not each of "
                           f"0 .. {count - 1} once")
    return [value for _, value in sorted(ran, key=lambda pair: pair[0])]


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
