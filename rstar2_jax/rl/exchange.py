"""What the hosts of a run tell each other in one RL step, behind one object (`StepExchange`).

On one process every method is the identity: the step's questions are taken in order, the
numbers and totals are this process's, and it trains on all of its rollouts; so a reader of the
step (`rstar2_jax.rl.step`) can read past each call. Across processes each goes through
`rstar2_jax.parallel.hosts` (the distributed runtime's key-value store, never the trainer's
device collectives): the hosts take the step's questions from a shared queue as their rows
free up, send each other the numbers of their rollouts (the selection and the metrics need
every rollout's), and send each rollout's tokens only to the host that trains on it.
"""
from __future__ import annotations

from typing import Callable

import jax
import numpy as np

from rstar2_jax.parallel import hosts
from rstar2_jax.rl.data import KeptRollouts, rollout_numbers
from rstar2_jax.sampler import Trajectory


class StepExchange:
    """The multi-host exchanges of one RL step, in the order the step makes them."""

    def claim(self, questions: int) -> Callable[[], int | None]:
        """The step's ``questions`` as a queue shared by the hosts (`AgentSampler.rollout`'s
        ``claim``): a question draws the same rollouts whichever host takes it."""
        return hosts.claims(questions)

    def numbers(self, ran: dict[int, list[Trajectory]], rewards: np.ndarray,
                questions: int) -> dict[str, np.ndarray]:
        """`rollout_numbers` of every host's questions, `[questions, n]` in question order;
        ``ran``: this host's trajectories by question, ``rewards`` `[questions, n]`."""
        numbers = hosts.gather(rollout_numbers(ran, rewards))
        order = hosts.question_order(numbers["question"].tolist(), questions)
        return {k: v[order] for k, v in numbers.items()}

    def totals(self, times: list[float], counts: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """The slowest host's ``times`` and the sum of every host's ``counts``."""
        per_host = hosts.gather({"times": np.array([times]), "counts": np.array([counts], np.int64)})
        return per_host["times"].max(axis=0), per_host["counts"].sum(axis=0)

    def training_share(self, ran: dict[int, list[Trajectory]], kept: KeptRollouts,
                       questions: int, n: int) -> tuple[KeptRollouts, list[Trajectory]]:
        """This host's part of the update: the kept rollouts of its block of the step's
        questions (indexed within the block) and the block's trajectories (question-major, ``n``
        each) whichever host sampled them. The update is the same whatever each host took."""
        block = hosts.share(questions)
        mine = kept.share(block.start * n, block.stop * n)
        if jax.process_count() == 1:
            trajs = [t for q in range(block.start, block.stop) for t in ran[q]]
        else:
            records = hosts.deliver({q: [t.record() for t in ts] for q, ts in ran.items()},
                                    list(range(block.start, block.stop)))
            trajs = [Trajectory.from_record(r) for question in records for r in question]
        return mine, trajs
