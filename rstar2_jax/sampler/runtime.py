"""The rollout side of a run: one object owns the sandbox pool, the verifier pool and the samplers.

    with RolloutRuntime(config.rollout) as runtime:        # starts both pools
        sampler = runtime.sampler(model_config, tokenizer, config.limits, SamplingParams(1.0))
        trajs, rewards, stats, _ = score_rollouts(sampler, runtime.verifier, params, problems,
                                                  prompts, samples=8, seed=0)

Training, evaluation and the toy's main job all use it; a job that runs several phases (SFT data,
evaluations, RL) enters one runtime and hands it to each. It is local to this host: nothing in
it knows about other processes. `score_rollouts`, the step that training and evaluation share
(sample, then score each rollout the moment it finishes), lives here too, below both of them.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import contextlib
import threading
import time
from typing import Callable

import numpy as np

from rstar2_jax.chat import ChatFormat
from rstar2_jax.data.datasets import Problem
from rstar2_jax.model import ModelConfig
from rstar2_jax.rewards import VerifierPool
from rstar2_jax.sampler import (
    AgentSampler,
    RolloutLimits,
    RolloutSettings,
    SamplingParams,
    Trajectory,
)
from rstar2_jax.sandbox import SandboxPool


class RolloutRuntime:
    """The sandbox pool, the verifier pool and the agentic samplers of one run on this host.

    Args:
      settings: slots, tool-output rendering and pool sizes (a job config's ``rollout``).

    Enter it once (``with``); leaving it stops both pools. ``sampler`` returns one sampler per
    (model config, tokenizer, limits, sampling): each compiles its engine on first use and
    keeps its cache until the runtime closes, so asking again for the same one is free.
    """

    def __init__(self, settings: RolloutSettings):
        self.settings = settings
        self._pools: tuple[SandboxPool, VerifierPool] | None = None
        self._stack = contextlib.ExitStack()
        self._samplers: dict[tuple, AgentSampler] = {}

    def __enter__(self) -> RolloutRuntime:
        if self._pools is not None:
            raise RuntimeError("this RolloutRuntime is already running")
        s = self.settings
        with contextlib.ExitStack() as stack:  # a pool that fails to start stops the other
            sandbox = stack.enter_context(
                SandboxPool(num_workers=s.sandbox_workers, **dataclasses.asdict(s.sandbox)))
            verifier = stack.enter_context(
                VerifierPool(num_workers=s.verifier_workers, timeout_s=s.verifier_timeout_s))
            self._stack = stack.pop_all()
        self._pools = sandbox, verifier
        return self

    def __exit__(self, *exc) -> None:
        self._samplers.clear()
        self._pools = None
        self._stack.close()

    @property
    def sandbox(self) -> SandboxPool:
        """Runs tool calls: ``submit(code, stdin) -> Future[ExecResult]``."""
        return self._running()[0]

    @property
    def verifier(self) -> VerifierPool:
        """Scores answers: ``submit(response_text, gold) -> Future[float]``."""
        return self._running()[1]

    def sampler(self, model_config: ModelConfig, tokenizer, limits: RolloutLimits,
                sampling: SamplingParams, fmt: ChatFormat = ChatFormat()) -> AgentSampler:
        """The agentic sampler of a model at these limits, sampling settings and chat format
        (tool calls go to this runtime's sandbox)."""
        sandbox = self.sandbox
        # The sampler holds the tokenizer, so its id cannot be reused while the entry exists.
        key = (model_config, id(tokenizer), limits, sampling, fmt)
        if key not in self._samplers:
            self._samplers[key] = AgentSampler(model_config, tokenizer, sandbox, self.settings,
                                               limits, sampling, fmt=fmt)
        return self._samplers[key]

    def _running(self) -> tuple[SandboxPool, VerifierPool]:
        if self._pools is None:
            raise RuntimeError("enter the RolloutRuntime (`with RolloutRuntime(...) as r:`) first")
        return self._pools


def score_rollouts(sampler: AgentSampler, verifier, params, problems: list[Problem],
                   prompts: list[list[int]], samples: int, seed: int, first_sequence: int = 0,
                   claim: Callable[[], int | None] | None = None, version: int = 0,
                   stop: threading.Event | None = None):
    """Rollouts and their rewards `[questions, samples]`; scoring starts as each one finishes.
    `seed`, `first_sequence`, `claim`, `version` and `stop` as `AgentSampler.rollout` takes them (with a claim,
    the rewards of the questions it did not hand out stay 0).

    Returns (trajectories, rewards, rollout stats, seconds spent waiting for rewards after the
    last rollout finished).
    """
    futures: dict[tuple[int, int], concurrent.futures.Future] = {}

    def score(t: Trajectory) -> None:
        if not t.truncated:  # a truncated rollout has no trustworthy final answer: reward 0
            futures[t.prompt_index, t.sample_index] = verifier.submit(
                t.response_text, problems[t.prompt_index].answer)

    trajs, stats = sampler.rollout(params, prompts, samples, on_finish=score, seed=seed,
                                   first_sequence=first_sequence, claim=claim, version=version,
                                   stop=stop)
    start = time.perf_counter()
    rewards = np.zeros((len(prompts), samples), np.float32)
    for (p, s), future in futures.items():
        rewards[p, s] = future.result()
    return trajs, rewards, stats, time.perf_counter() - start
