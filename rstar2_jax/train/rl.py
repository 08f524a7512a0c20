"""The RL training loop: rollouts, rewards, selection, update, repeated.

One RL step, for `questions_per_step` questions (docs/algorithms.md):

    rollouts      n per question through the agentic sampler (tools run while rows decode)
    rewards       each finished rollout is scored by the verifier pool at once (overlapping
                  the rollouts still running); a truncated rollout scores 0
    selection     the algorithm's: for GRPO-RoC, drop questions whose 2G rewards are all
                  equal, RoC down to G; then the algorithm's advantages
    update        old log-probs by the training forward (the first update of a run stops
                  if they disagree with the sampler's: rl.first_step_gap_limit), the
                  rollout correction if any, the algorithm's loss, optax

The algorithm (`rstar2_jax.algorithms.Algorithm`) is a value: the one ``rl.algorithm`` names, or
one passed to `run_rl`.

The sampler reads the updated params directly: same process, no weight copy. Across several
processes the hosts take the step's questions from a shared queue as their engines free rows,
roll them out with their own tool and verifier pools, exchange the trajectories, and each trains
on the rollouts of its block of the step's questions (`rstar2_jax.hosts`). Everything random
(question order, rollout draws, RoC sampling) derives from the run's seed and step, so a resumed
run repeats the uninterrupted one.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from rstar2_jax import chat
from rstar2_jax.algorithms import Algorithm, resolve_algorithm
from rstar2_jax.data.datasets import Problem, load_problems
from rstar2_jax.errors import ConfigError, MismatchError
from rstar2_jax.hosts import claims, gather, gather_questions, serving_params, share as host_share
from rstar2_jax.model import load_hf
from rstar2_jax.rewards import VerifierPool
from rstar2_jax.runtime import RolloutRuntime, score_rollouts
from rstar2_jax.sampler import AgentSampler, SamplingParams, Trajectory
from rstar2_jax.sampler.engine import bucket
from rstar2_jax.tokenizer import open_tokenizer
from rstar2_jax.train.checkpoint import Checkpointer
from rstar2_jax.train.configs import RLJobConfig
from rstar2_jax.train.rl_data import (
    check_algorithm,
    check_trained_ids,
    make_batch,
    rollout_arrays,
    rollout_metrics,
    select_rollouts,
)
from rstar2_jax.train.rl_update import RLUpdate, train_loss
from rstar2_jax.train.run import Run, start_run
from rstar2_jax.train.step import TrainState

log = logging.getLogger(__name__)


def question_batch(num_problems: int, per_step: int, step: int, seed: int) -> np.ndarray:
    """Problem indices of RL step `step` (0-based): consecutive slices of a seeded permutation per
    epoch, so the data position is just the step number."""
    if per_step > num_problems:
        raise ValueError(f"questions_per_step={per_step} exceeds the {num_problems} problems")
    per_epoch = num_problems // per_step
    epoch, index = divmod(step, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(num_problems)
    return order[index * per_step:(index + 1) * per_step]


@dataclasses.dataclass
class RLLoop:
    """The parts one RL step needs; `step` runs one and returns its metrics."""

    config: RLJobConfig
    algorithm: Algorithm
    tokenizer: object
    fmt: chat.ChatFormat
    problems: list[Problem]
    sampler: AgentSampler
    verifier: VerifierPool
    update: RLUpdate
    pad_id: int
    checked_mismatch: bool = False  # the first update of this process's run checks the gap

    def step(self, state: TrainState, step: int, rng: jax.Array) -> tuple[TrainState, dict]:
        rl = self.config.rl
        n = rl.rollouts_per_question
        indices = question_batch(len(self.problems), rl.questions_per_step, step, self.config.seed)
        problems = [self.problems[i] for i in indices]
        prompts = [chat.encode_prompt(self.tokenizer, p.question, self.fmt) for p in problems]
        step_key = jax.random.fold_in(rng, step)
        rollout_seed = int(jax.random.randint(step_key, (), 0, 2**31 - 1))
        # Each host takes the step's questions from a shared queue as its rows free up
        # (rstar2_jax.hosts); a question draws the same rollouts whichever host takes it.
        trajs, rewards, stats, reward_wait = score_rollouts(
            self.sampler, self.verifier, serving_params(state.params), problems, prompts, n,
            rollout_seed, claim=claims(len(problems)))
        trajs, rewards = _all_questions(trajs, rewards, n)
        hosts = gather({
            "times": np.array([[stats.wall_s, stats.tool_wait_s, reward_wait]]),
            "counts": np.array([[stats.generated_tokens, stats.preemptions]], np.int64)})
        rollouts = rollout_arrays(trajs, rewards)
        kept = select_rollouts(self.algorithm, jax.random.fold_in(step_key, 1), rollouts,
                               rl.group_size)
        rollout_s, tool_wait_s, reward_wait_s = hosts["times"].max(axis=0)  # the slowest host's
        tokens, preemptions = hosts["counts"].sum(axis=0)
        response_lengths = np.array([len(t.response_ids) for t in trajs], np.int32)
        metrics = rollout_metrics(rollouts, kept, response_lengths) | {
            "time/rollout_s": rollout_s, "time/tool_wait_s": tool_wait_s,
            "time/reward_wait_s": reward_wait_s,
            "perf/rollout_tokens_per_s": tokens / max(rollout_s, 1e-9),
            "rollouts/preemptions": preemptions}
        start = time.perf_counter()
        if kept.index.size:
            # Each process trains on the rollouts of its block of the step's questions, whichever
            # host sampled them: the update is the same whatever each host took.
            limits = self.config.limits
            share = host_share(len(indices))
            mine = kept.share(share.start * n, share.stop * n)
            block = trajs[share.start * n:share.stop * n]
            most = int(np.bincount(kept.index // len(block)).max())  # kept rows of the fullest host
            batch = make_batch(block, mine, pad_id=self.pad_id,
                               seq_len=limits.max_prompt_tokens + limits.max_response_tokens,
                               rows=bucket(most, minimum=1))
            check_trained_ids(batch, block, mine, self._encode_tool_response)
            check = None if self.checked_mismatch else self._check_mismatch
            state, update_metrics = self.update(state, batch, check=check)
            self.checked_mismatch = True
            metrics |= update_metrics
        else:
            log.warning("RL step %d: the selection kept no rollout to train on (every group's "
                        "rewards were equal); no update", step + 1)
        metrics["time/update_s"] = time.perf_counter() - start
        metrics["perf/update_tokens_per_s"] = metrics.get("tokens", 0.0) / metrics["time/update_s"]
        # One RL step may take several optimizer updates (mini-batches) or none; the train
        # state's step counts RL steps, the optimizer keeps its own count for the schedule.
        state = state._replace(step=_set_step(state.step, step + 1))
        return state, {k: float(v) for k, v in metrics.items()}

    def _encode_tool_response(self, text: str) -> list[int]:
        return chat.encode_tool_response(self.tokenizer, text, self.fmt)

    def _check_mismatch(self, stats: dict[str, float]) -> None:
        """Stops the run (MismatchError) when the sampler's and the trainer's log-probs of the
        first update's tokens disagree beyond ``rl.first_step_gap_limit``."""
        limit, gap = self.config.rl.first_step_gap_limit, stats["logprob_mismatch/log_ppl_abs_diff"]
        if limit is None or gap <= limit:
            return
        rl, rollout = self.config.rl, self.config.rollout
        raise MismatchError(
            f"the sampler and the trainer disagree on the first update's tokens: their "
            f"log-perplexities differ by {gap:.3g} nats per token (mean over sequences) > "
            f"rl.first_step_gap_limit={limit:g} (KL(sampler || trainer) "
            f"{stats['logprob_mismatch/kl']:.3g}, token ratio trainer/sampler from "
            f"{stats['logprob_mismatch/ratio_min']:.3g} to {stats['logprob_mismatch/ratio_max']:.3g}); "
            f"likely causes: the sampler drew at another temperature than the "
            f"rl.temperature={rl.temperature:g} the trainer divides by, it served other weights "
            f"than the trainer's (another checkpoint), or rollout.serving_dtype="
            f"{rollout.serving_dtype} is too coarse for this model; raise rl.first_step_gap_limit, "
            f"or set it to null, if the gap is expected")


def _all_questions(trajs: list[Trajectory], rewards: np.ndarray,
                   n: int) -> tuple[list[Trajectory], np.ndarray]:
    """The step's trajectories (question-major) and rewards `[questions, n]` from every
    process's: ``trajs`` are this process's, of the questions it took, ``rewards`` its
    `[questions, n]` (0 for the others' questions). On one process they are all of them
    already, and nothing is converted."""
    if jax.process_count() == 1:
        return trajs, rewards
    mine = {}
    for q in sorted({t.prompt_index for t in trajs}):
        ran = trajs[len(mine) * n:(len(mine) + 1) * n]
        mine[q] = {"trajectories": [t.record() for t in ran], "rewards": rewards[q].tolist()}
    every = gather_questions(len(rewards), mine)
    return ([Trajectory.from_record(t) for q in every for t in q["trajectories"]],
            np.array([q["rewards"] for q in every], np.float32).reshape(rewards.shape))


@jax.jit
def _set_step(old: jax.Array, new: int) -> jax.Array:
    # Under jit, so that a step counter shared by several processes is set by each of them.
    return jnp.full_like(old, new)


def reference_params(config: RLJobConfig, run: Run):
    """The reference policy of ``rl.reference``: the stage's initial weights, as a copy in the
    compute dtype laid out like the params (the forward casts weights to that dtype anyway, so
    the copy gives the same log-probs as the weights it was taken from). At the stage's first
    step they are the run's params; a resumed run reads them again where the stage started
    from (the newest checkpoint of ``stage.init_from``, else ``model.path``)."""
    params = run.state.params
    if run.step != run.start_step:  # resumed: the params have moved
        if config.stage.init_from is not None:
            previous = Checkpointer(Path(config.stage.init_from) / "checkpoints")
            restored = previous.restore_latest(run.state, params_only=True)
            previous.close()
            if restored is None:
                raise FileNotFoundError(f"stage.init_from={config.stage.init_from!r} has no "
                                        "readable checkpoint to read the reference policy from")
            params = restored.state.params
        else:
            _, params = load_hf(config.model.path, dtype=config.precision.params)
    dtype = run.compute_config.jnp_dtype
    shardings = jax.tree.map(lambda x: x.sharding, run.state.params)
    # A copy even in the same dtype: the train step donates (frees) the params it is given.
    return jax.jit(lambda p: jax.tree.map(lambda x: jnp.copy(x.astype(dtype)), p),
                   out_shardings=shardings)(params)


def run_rl(config: RLJobConfig, *, algorithm: Algorithm | None = None,
           runtime: RolloutRuntime | None = None,
           on_step: Callable[[int, dict], None] | None = None, progress: bool = True) -> TrainState:
    """Runs one RL stage (`config.stage`), resuming from `run_dir` when it has a checkpoint.

    `algorithm` is the RL algorithm to train with; without one, the one `config.rl.algorithm`
    names. It is checked on a tiny made-up step before anything starts. `runtime` runs the
    rollouts (a job with several phases passes the one it has entered; its settings must be
    `config.rollout`); without one the stage starts its own. `on_step(step, metrics)` is called
    after each step is logged. Returns the final state.
    """
    if config.rl.questions_per_step % jax.process_count():
        raise ConfigError(f"rl.questions_per_step={config.rl.questions_per_step} does not split "
                          f"evenly over the run's {jax.process_count()} processes")
    if algorithm is None:
        algorithm = resolve_algorithm(config.rl.algorithm)
    # The loss as the update will train with it: with the run's entropy bonus and KL penalty.
    check_algorithm(dataclasses.replace(algorithm, loss=train_loss(algorithm.loss, config.rl)),
                    config.rl.rollouts_per_question, config.rl.group_size,
                    token_advantages=config.rl.rollout_correction.weights != "none")
    if runtime is None:
        with RolloutRuntime(config.rollout) as runtime:
            return _run_rl(config, algorithm, runtime, on_step, progress)
    return _run_rl(config, algorithm, runtime, on_step, progress)


def _run_rl(config: RLJobConfig, algorithm: Algorithm, runtime: RolloutRuntime,
            on_step: Callable[[int, dict], None] | None, progress: bool) -> TrainState:
    if runtime.settings != config.rollout:
        raise ValueError(f"the runtime's settings {runtime.settings} are not the config's "
                         f"rollout settings {config.rollout}")
    fmt = chat.get_format(config.model.chat_format)
    tokenizer = open_tokenizer(config.model.path, config.model.tokenizer_path, fmt)
    problems = load_problems(config.stage.dataset)
    run = start_run(run_dir=config.run_dir, model=config.model, optimizer=config.optimizer,
                    total_steps=config.stage.steps, job_config=config, seed=config.seed,
                    mesh=config.mesh, checkpoint=config.checkpoint,
                    init_from=config.stage.init_from,
                    reset_optimizer=config.stage.reset_optimizer, precision=config.precision,
                    progress=progress)
    try:
        loop = RLLoop(
            config=config, algorithm=algorithm, tokenizer=tokenizer, fmt=fmt,
            problems=problems, verifier=runtime.verifier,
            sampler=runtime.sampler(run.compute_config, tokenizer, config.limits,
                                    SamplingParams(temperature=config.rl.temperature), fmt),
            update=RLUpdate(run.compute_config, config.rl, run.optimizer, mesh=run.mesh,
                            param_specs=run.param_specs, params=run.state.params,
                            loss=algorithm.loss,
                            reference=reference_params(config, run) if config.rl.reference else None),
            pad_id=tokenizer.pad_token_id or 0)
        for step in range(run.step, run.end_step):
            state, metrics = loop.step(run.state, step, run.rng)
            run.finish_step(state, metrics, rng=run.rng, data_position={"step": step + 1})
            if on_step is not None:
                on_step(run.step, metrics)
        return run.state
    finally:
        run.close()
