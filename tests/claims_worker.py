"""One process of the 2-process claim test (tests/test_multiprocess.py), started with the
JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID variables.

Skewed on purpose, deterministically: process 1 takes one question, then waits until process 0
has taken all the others. Each process rolls out what it took; the gathered step must equal the
step one process rolls out in order. Prints this process's questions as JSON. With ``die``,
process 1 exits after taking its question, before the exchange."""
import json
import os
import sys

from rstar2_jax.parallel.distributed import initialize_from_env

initialize_from_env()

import jax  # noqa: E402
from jax._src.distributed import global_state  # noqa: E402

from claims_setup import SAMPLES, drawn, make_setup  # noqa: E402
from rstar2_jax.parallel import hosts  # noqa: E402
from rstar2_jax.sampler import Trajectory  # noqa: E402

WAIT_MS = 300_000
client, me = global_state.client, jax.process_index()
queue = hosts.claims(6)
taken = []


def claim():
    if me == 0 and not taken:
        client.blocking_key_value_get("test/p1_took", WAIT_MS)
    if me == 1 and taken:
        client.blocking_key_value_get("test/p0_done", WAIT_MS)
    q = queue()
    if me == 1 and not taken:
        client.key_value_set("test/p1_took", "1")
        if sys.argv[1:] == ["die"]:
            os._exit(3)
    if me == 0 and q is None:
        client.key_value_set("test/p0_done", "1")
    taken.append(q)
    return q




def step(claim):
    """The step's trajectories gathered from both processes, and the questions this one ran."""
    mine, _ = sampler.rollout(params, prompts, SAMPLES, seed=11, claim=claim)
    by_question = {}
    for t in mine:
        by_question.setdefault(t.prompt_index, []).append(t.record())
    gathered = hosts.gather_questions(6, by_question)
    return [Trajectory.from_record(t) for ts in gathered for t in ts], sorted(by_question)


sampler, params, prompts = make_setup()
skewed, ran = step(claim)
whole, _ = sampler.rollout(params, prompts, SAMPLES, seed=11)
assert [(t.prompt_index, t.sample_index) for t in skewed] == [(t.prompt_index, t.sample_index) for t in whole]
assert drawn(skewed) == drawn(whole), "the balanced step differs from the in-order one"
# A second step's queue is a new one: its questions are handed out afresh.
again, _ = step(hosts.claims(6))
assert drawn(again) == drawn(whole)
print(json.dumps(ran))
