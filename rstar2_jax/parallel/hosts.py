"""Work split across JAX processes (hosts): which questions each host samples and what the hosts
tell each other (the params a host's sampler reads: `rstar2_jax.parallel.roles`).

An RL step's or an evaluation's questions are a shared queue (`claims`): each host takes the
next question as a row of its engine frees up, so a host whose questions finish early takes more
of them and the step does not wait for the host that drew the longest ones. An RL step's update
still trains each host on a contiguous block of the questions (`share`). Each host samples with its own sampler,
sandbox and verifier pools, so a tool call never leaves the host that made it. Sampling keys are
indexed by a rollout's position in the whole step (`AgentSampler.rollout`'s
``first_sequence``), so a rollout draws the same tokens whichever host runs it, and the result
depends neither on the process count nor on which host took which question.

The hosts then exchange what they sampled: `gather`, arrays every host needs (an RL step's
per-rollout numbers, which the selection and the metrics read); `deliver`, values only some
hosts need (an RL step's trajectories, to the host that trains on them); `gather_questions`,
values of every question to every host, in question order (an evaluation's per-sample records).
Exchanges go through the key-value store of JAX's distributed runtime, not through device
collectives: they touch no device, so a sampler thread can exchange while the trainer's
collectives run on the training devices (`rl.max_staleness` > 0 across processes). Each
exchange belongs to a *channel* ("rollout": the sampler's side; "train": the trainer's), and the
k-th exchange of a channel on one process pairs with the k-th of that channel on every other
process, whichever thread makes it. A host that finished early waits in the exchange (a
blocking read, not a busy loop); if another host died, the distributed runtime's heartbeat
timeout stops it (`rstar2_jax.parallel.distributed`).

On one process every function here is the identity (or the whole range, in order).
"""
from __future__ import annotations

import collections
import io
import itertools
import json
import threading
from typing import Callable, Sequence

import jax
import numpy as np

from rstar2_jax.sampler.feeder import in_order


def share(count: int) -> slice:
    """This process's block of ``count`` items: block `jax.process_index()` of
    `jax.process_count()` contiguous blocks whose sizes differ by at most one (the first ones
    larger)."""
    processes, index = jax.process_count(), jax.process_index()
    base, extra = divmod(count, processes)
    start = index * base + min(index, extra)
    return slice(start, start + base + (index < extra))


# The k-th call of a kind on a channel pairs up with every other process's k-th: each process
# makes the same sequence of them per channel, as collectives pair up.
_counts: dict[str, itertools.count] = collections.defaultdict(itertools.count)
# Per channel, the keys this process wrote and may not delete yet, with the number of the
# message that wrote them.
_written: dict[str, list[tuple[int, str]]] = collections.defaultdict(list)
_lock = threading.Lock()

# A process waits this long for another's part of an exchange before it gives up; a dead process
# is caught sooner, by the distributed runtime's heartbeats. A host that drew short questions
# waits for the others' rollouts here, so this bounds a step's spread, not a message's delay.
EXCHANGE_TIMEOUT_S = 24 * 3600
# Values are stored in pieces of at most this size (the runtime's gRPC messages stay small).
_PIECE_BYTES = 32 << 20


def _number(kind: str) -> int:
    with _lock:
        return next(_counts[kind])


def _client():
    # The runtime's client is not public API in JAX 0.10.2 (orbax and JAX's own checkpointing
    # use it the same way).
    from jax._src.distributed import global_state

    return global_state.client


def claims(count: int, channel: str = "rollout") -> Callable[[], int | None]:
    """A queue of ``count`` items shared by the run's processes: each call hands this process
    the next item no process has taken, ``0 .. count - 1`` in turn, then None. Every process
    makes the same sequence of queues on a channel (the k-th `claims` call of each process
    shares the k-th queue). On one process: the items in order.

    The queue is a counter in the key-value store of JAX's distributed runtime (process 0's
    coordination service), taken with an atomic increment: one round trip, about 0.35 ms on
    localhost. A process that dies stops the others (`rstar2_jax.parallel.distributed`).
    """
    if jax.process_count() == 1:
        return in_order(count)
    client, key = _client(), f"rstar2_jax/claims/{channel}/{_number(f'claims/{channel}')}"

    def claim() -> int | None:
        taken = client.key_value_increment(key, 1) - 1  # the counter's value after this claim
        return taken if taken < count else None

    return claim


def _put(client, key: str, data: bytes) -> None:
    pieces = [data[i:i + _PIECE_BYTES] for i in range(0, len(data), _PIECE_BYTES)] or [b""]
    for i, piece in enumerate(pieces):
        client.key_value_set_bytes(f"{key}/{i}", piece)
    client.key_value_set(f"{key}/pieces", str(len(pieces)))  # last: the value is whole


def _get(client, key: str, writer: str) -> bytes:
    wait_ms = EXCHANGE_TIMEOUT_S * 1000
    try:
        count = int(client.blocking_key_value_get(f"{key}/pieces", wait_ms))
    except Exception as e:  # the runtime raises its own error type for a deadline
        if "DEADLINE_EXCEEDED" not in str(e):
            raise
        raise TimeoutError(f"{writer} wrote nothing to {key} in {EXCHANGE_TIMEOUT_S} s") from e
    return b"".join(client.blocking_key_value_get_bytes(f"{key}/{i}", wait_ms) for i in range(count))


def exchange(data: bytes, channel: str = "rollout") -> list[bytes]:
    """Every process's ``data``, in process order (``[data]`` on one process), through the
    key-value store of JAX's distributed runtime. Raises TimeoutError when a process has not
    sent its part within `EXCHANGE_TIMEOUT_S`."""
    if jax.process_count() == 1:
        return [data]
    client, number, me = _client(), _number(channel), jax.process_index()
    prefix = f"rstar2_jax/{channel}/{number}"
    _put(client, f"{prefix}/{me}", data)
    parts = [_get(client, f"{prefix}/{p}", f"process {p}") for p in range(jax.process_count())]
    # Every process sent its part of this message after it had read all it wanted of the
    # channel's earlier ones: nobody reads this process's keys of those again.
    with _lock:
        done = [key for n, key in _written[channel] if n < number]
        _written[channel] = [(n, key) for n, key in _written[channel] if n >= number]
        _written[channel].append((number, f"{prefix}/{me}"))
    for key in done:
        client.key_value_delete(key)
    return parts


def deliver(mine: dict[int, object], wanted: Sequence[int], channel: str = "rollout") -> list:
    """The JSON-serialisable values of items ``wanted``, in that order, each written by the one
    process that has it in ``mine`` (item index -> value): a value goes through the key-value
    store once and only to the processes that want it, where `gather_questions` sends every
    value to every process. Every process must call it (the k-th call of each pairs up), and
    every wanted item must be in some process's ``mine`` (one process waits for it otherwise,
    up to `EXCHANGE_TIMEOUT_S`). On one process: ``[mine[i] for i in wanted]``."""
    if jax.process_count() == 1:
        return [mine[i] for i in wanted]
    client, number = _client(), _number(channel)
    prefix = f"rstar2_jax/{channel}/{number}"
    for item, value in mine.items():
        _put(client, f"{prefix}/item{item}", json.dumps(value).encode())
    with _lock:  # deleted after the channel's next exchange (see `exchange`)
        _written[channel] += [(number, f"{prefix}/item{item}") for item in mine]
    return [json.loads(_get(client, f"{prefix}/item{i}", f"the process that ran item {i}"))
            for i in wanted]


def gather_questions(count: int, mine: dict[int, object], channel: str = "rollout") -> list:
    """Every process's JSON-serialisable values of the questions it ran (``mine``: question
    index -> value), in question order ``0 .. count - 1``. Raises RuntimeError unless the
    processes ran every question exactly once between them."""
    ran = [pair for values in gather_objects(sorted(mine.items()), channel) for pair in values]
    return [ran[i][1] for i in question_order([q for q, _ in ran], count)]


def question_order(questions: Sequence[int], count: int) -> np.ndarray:
    """The permutation that sorts ``questions`` (every process's, gathered) into ``0 .. count -
    1``. Raises RuntimeError unless the processes ran every question exactly once between
    them."""
    if sorted(questions) != list(range(count)):
        raise RuntimeError(f"the processes ran questions {sorted(questions)} between them, not "
                           f"each of 0 .. {count - 1} once")
    return np.argsort(np.asarray(questions), kind="stable")


def gather(tree, channel: str = "rollout"):
    """Every process's host arrays (the same structure on each, shapes equal but for the first
    axis), concatenated on their first axis in process order."""
    if jax.process_count() == 1:
        return tree
    leaves, structure = jax.tree.flatten(tree)
    buffer = io.BytesIO()
    np.savez(buffer, *[np.asarray(x) for x in leaves])
    parts = []
    for data in exchange(buffer.getvalue(), channel):
        with np.load(io.BytesIO(data), allow_pickle=False) as arrays:
            parts.append([arrays[f"arr_{i}"] for i in range(len(leaves))])
    return jax.tree.unflatten(structure, [np.concatenate(xs) for xs in zip(*parts)])


def gather_objects(value, channel: str = "rollout") -> list:
    """Every process's JSON-serialisable ``value``, in process order."""
    if jax.process_count() == 1:
        return [value]
    return [json.loads(data) for data in exchange(json.dumps(value).encode(), channel)]
