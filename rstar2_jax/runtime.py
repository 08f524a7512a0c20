"""The rollout side of a run: agentic rollouts and their rewards.

Training and evaluation both sample problems and score every sample; that shared step lives
here, below both of them.
"""
from __future__ import annotations

import concurrent.futures
import time

import numpy as np

from rstar2_jax.data.datasets import Problem
from rstar2_jax.sampler import AgentSampler, Trajectory


def score_rollouts(sampler: AgentSampler, verifier, params, problems: list[Problem],
                   prompts: list[list[int]], samples: int, seed: int):
    """Rollouts and their rewards `[questions, samples]`; scoring starts as each one finishes.

    Returns (trajectories, rewards, rollout stats, seconds spent waiting for rewards after the
    last rollout finished).
    """
    futures: dict[tuple[int, int], concurrent.futures.Future] = {}

    def score(t: Trajectory) -> None:
        if not t.truncated:  # a truncated rollout has no trustworthy final answer: reward 0
            futures[t.prompt_index, t.sample_index] = verifier.submit(
                t.response_text, problems[t.prompt_index].answer)

    trajs, stats = sampler.rollout(params, prompts, samples, on_finish=score, seed=seed)
    start = time.perf_counter()
    rewards = np.zeros((len(prompts), samples), np.float32)
    for (p, s), future in futures.items():
        rewards[p, s] = future.result()
    return trajs, rewards, stats, time.perf_counter() - start
