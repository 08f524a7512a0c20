"""An RL step across JAX processes (hosts): what each host rolls out and what the hosts share.

Each host rolls out its own contiguous share of the step's questions, with its own sampler,
sandbox and verifier pools: a tool call never leaves the host that made it. Rollout keys are
indexed by the rollout's position in the whole step (`AgentSampler.rollout`'s
``first_sequence``), so a rollout draws the same tokens whichever host runs it.

The hosts then exchange only the per-rollout summary the algorithm selects on (`Rollouts`,
``[questions, n]`` small integers and rewards, a few kilobytes) and run the same selection on
the same arrays with the same key, so every host knows every kept rollout and its advantage
without a coordinator; a host that finished early waits in that exchange (a blocking
collective, not a busy loop). Groups are questions, so a host trains on rows of its own
rollouts only and contributes them to the update with ``make_array_from_process_local_data``.

On one process every function here is the identity (or the whole range).
"""
from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils


def question_share(num_questions: int) -> slice:
    """The questions of a step that this process rolls out: block `jax.process_index()` of
    `jax.process_count()` equal blocks. Raises ValueError when they do not split evenly."""
    count, index = jax.process_count(), jax.process_index()
    if num_questions % count:
        raise ValueError(f"rl.questions_per_step={num_questions} does not split over "
                         f"{count} processes")
    per_host = num_questions // count
    return slice(index * per_host, (index + 1) * per_host)


def gather(tree):
    """Every process's host arrays (the same structure and shapes on each), concatenated on
    their first axis in process order."""
    if jax.process_count() == 1:
        return tree
    return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))


def serving_params(params):
    """The params this process's sampler reads: the trainer's own on one process; a full copy
    on this host's first device when the trainer's are split across processes (a sampler on
    one host cannot read another host's shards)."""
    if jax.process_count() == 1:
        return params
    full = multihost_utils.process_allgather(params, tiled=True)
    return jax.device_put(full, jax.local_devices()[0])
