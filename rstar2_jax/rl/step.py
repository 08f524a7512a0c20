"""One RL step, top to bottom: rollout -> score -> select and advantages -> batch -> update.

`RLStep.rollout` is the sampler's side of a step and `RLStep.train` the trainer's; the
synchronous loop calls one after the other (`RLStep.__call__`), the asynchronous pipeline runs
them in two threads, the rollouts k updates behind (`rstar2_jax.rl.loop`). What the hosts of a
multi-process run tell each other is `self.hosts` (`rstar2_jax.rl.exchange`): the identity on
one process. Everything random derives from the run's seed and the step, so a resumed run
repeats the uninterrupted one.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time

import jax
import jax.numpy as jnp

from rstar2_jax import chat
from rstar2_jax.algorithms import Algorithm, Rollouts
from rstar2_jax.data.datasets import Problem
from rstar2_jax.parallel.roles import ServingCopy
from rstar2_jax.rewards import VerifierPool
from rstar2_jax.rl.data import (StepRollouts, by_question, check_trained_ids, make_batch,
                                question_batch, select_rollouts, step_metrics, trained_versions)
from rstar2_jax.rl.exchange import StepExchange
from rstar2_jax.rl.update import RLUpdate, mismatch_check
from rstar2_jax.sampler import AgentSampler
from rstar2_jax.sampler.runtime import score_rollouts
from rstar2_jax.train.configs import RLJobConfig
from rstar2_jax.train.step import TrainState

log = logging.getLogger(__name__)


@dataclasses.dataclass
class RLStep:
    """The parts one RL step needs; ``step(state, s, rng)`` runs step ``s`` synchronously."""

    config: RLJobConfig
    algorithm: Algorithm
    tokenizer: object
    fmt: chat.ChatFormat
    problems: list[Problem]
    sampler: AgentSampler
    verifier: VerifierPool
    update: RLUpdate
    pad_id: int
    copy: ServingCopy  # the trainer's params -> the sampler's
    hosts: StepExchange = dataclasses.field(default_factory=StepExchange)
    # The first update of this process's run whose rollouts the trained params sampled checks
    # the sampler/trainer gap.
    checked_mismatch: bool = False

    def rollout(self, params, step: int, rng: jax.Array, version: int,
                stop: threading.Event | None = None) -> StepRollouts:
        """The sampler's side of step ``step``, with ``params`` (policy ``version``, stamped on
        every token). ``stop`` ends it early with `RolloutStopped`."""
        rl, n = self.config.rl, self.config.rl.rollouts_per_question
        seed, selection_key = _step_keys(rng, step)
        # -- 1. Rollout: n per question; tool calls run while the other rows decode -----------
        questions = question_batch(len(self.problems), rl.questions_per_step, step, self.config.seed)
        problems = [self.problems[i] for i in questions]
        prompts = [chat.encode_prompt(self.tokenizer, p.question, self.fmt) for p in problems]
        # -- 2. Score: each rollout verified as it finishes; a truncated one scores 0 ----------
        # Nothing else scores with the run's verifier pool: the change of its counters is ours.
        verifier_before = self.verifier.stats()
        trajs, rewards, stats, reward_wait = score_rollouts(
            self.sampler, self.verifier, params, problems, prompts, n,
            seed=int(seed),
            claim=self.hosts.claim(len(problems)), version=version, stop=stop)
        ran = by_question(trajs, n)
        numbers = self.hosts.numbers(ran, rewards, len(problems))
        rollouts = Rollouts(**{k: numbers[k] for k in Rollouts._fields})
        # -- 3. Select and advantages: the algorithm's (GRPO-RoC: drop all-equal groups, RoC) --
        kept = select_rollouts(self.algorithm, selection_key, rollouts, rl.group_size)
        verifier = self.verifier.stats()
        times, counts = self.hosts.totals(
            [stats.wall_s, stats.tool_wait_s, reward_wait],
            [stats.generated_tokens, stats.preemptions, verifier.timeouts - verifier_before.timeouts,
             verifier.errors - verifier_before.errors])
        metrics = step_metrics(rollouts, kept, numbers, times, counts)
        # -- 4. Batch: this host's kept rollouts as rows; the ids trained on = the ids sampled -
        batch = None
        if kept.index.size:
            mine, block = self.hosts.training_share(ran, kept, len(problems), n)
            # The row layout the loss reads takes every rollout of the host's block, the most
            # it can keep: the update's shapes do not depend on the step (`RLUpdate`).
            limits = self.config.limits
            batch = make_batch(block, mine, pad_id=self.pad_id,
                               seq_len=limits.max_prompt_tokens + limits.max_response_tokens,
                               rows=len(block))
            check_trained_ids(batch, block, mine, self._encode_tool_response)
        return StepRollouts(step, batch, trained_versions(numbers, kept.index), metrics)

    def train(self, state: TrainState, rollouts: StepRollouts) -> tuple[TrainState, dict]:
        """The trainer's side of step ``rollouts.step``, from ``state`` (the policy after that
        many steps): returns the new state and the step's metrics, the staleness of the trained
        tokens among them (updates between the policy that sampled a token and this one)."""
        step, metrics = rollouts.step, dict(rollouts.metrics)
        count, total, oldest = rollouts.versions.T
        start = time.perf_counter()
        # -- 5. Update: proximal log-probs, rollout correction, the algorithm's loss, optax ----
        if rollouts.batch is not None:
            # The guard reads the gap of rollouts these params sampled: staleness adds its own.
            check = None
            if not self.checked_mismatch and oldest.min() == step:
                check = mismatch_check(self.config)
            state, update_metrics = self.update(state, rollouts.batch, check=check)
            self.checked_mismatch |= check is not None
            metrics |= update_metrics
        else:
            log.warning("RL step %d: the selection kept no rollout to train on (every group's "
                        "rewards were equal); no update", step + 1)
        metrics["time/update_s"] = time.perf_counter() - start
        metrics["perf/update_tokens_per_s"] = metrics.get("tokens", 0.0) / metrics["time/update_s"]
        metrics |= {"staleness/mean": float(step - total.sum() / count.sum()),
                    "staleness/max": float(step - oldest.min())}
        # The state's step counts RL steps (one may take several optimizer updates, or none).
        state = state._replace(step=_set_step(state.step, step + 1))
        return state, {k: float(v) for k, v in metrics.items()}

    def __call__(self, state: TrainState, step: int, rng: jax.Array) -> tuple[TrainState, dict]:
        """Step ``step`` synchronously: rollouts of ``state``'s params, then the update. Each
        side idles while the other runs: ``time/trainer_wait_s``, ``time/sampler_wait_s``."""
        start = time.perf_counter()
        params = state.params if self.copy.rollout is None else self.copy(state.params)
        copied = time.perf_counter()
        rollouts = self.rollout(params, step, rng, version=step)
        del params
        sampling_s = time.perf_counter() - copied
        state, metrics = self.train(state, rollouts)
        return state, metrics | {"time/trainer_wait_s": sampling_s,
                                 "time/sampler_wait_s": metrics["time/update_s"],
                                 "time/weight_copy_s": copied - start}

    def programs(self) -> dict[str, int]:
        """The most programs the steps compile, by JAX's names, whatever each keeps: the
        update's, the sampler's, the trainer -> sampler copy when there is one, the step's
        keys and counter. (The algorithm's selection and advantages compile theirs when it is
        checked, at the run's shape: `check_algorithm`.)"""
        copy = {"jit(cast)": 1} if self.copy.rollout is not None or self.config.rl.max_staleness else {}
        return (self.update.programs() | self.sampler.programs() | copy
                | {"jit(_step_keys)": 1, "jit(_set_step)": 1})

    def _encode_tool_response(self, text: str) -> list[int]:
        return chat.encode_tool_response(self.tokenizer, text, self.fmt)


@jax.jit
def _step_keys(rng: jax.Array, step: int | jax.Array) -> tuple[jax.Array, jax.Array]:
    """Step ``step``'s sampling seed and selection key, from the run's key: one program, the
    step traced (eager `jax.random` calls would be a program each)."""
    key = jax.random.fold_in(rng, step)
    return jax.random.randint(key, (), 0, 2**31 - 1), jax.random.fold_in(key, 1)


@jax.jit
def _set_step(old: jax.Array, new: int) -> jax.Array:
    # Under jit, so that a step counter shared by several processes is set by each of them.
    return jnp.full_like(old, new)
