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

Synchronous (``rl.max_staleness=0``, the default): each step's rollouts come from the params it
trains; on one process without rollout devices the sampler reads the trainer's params directly,
no weight copy. Asynchronous (k > 0): a sampler thread rolls out step s with the policy after
update max(start, s - k), from its own copy in the serving dtype, while the trainer updates on
earlier steps (`_pipelined`; docs/algorithms.md "Asynchronous RL"); with
``mesh.rollout_devices`` the two sides run on disjoint devices and the copy goes device to
device (`rstar2_jax.parallel.roles`). Across several processes the hosts take the step's questions from
a shared queue as their engines free rows, roll them out with their own tool and verifier pools,
exchange the rollouts' numbers through the distributed runtime's key-value store, and each trains
on the rollouts of its block of the step's questions, whose trajectories alone it receives
(`rstar2_jax.parallel.hosts`). Everything random
(question order, rollout draws, RoC sampling) derives from the run's seed and step, so a resumed
run repeats the uninterrupted one (at k = 0: under k > 0 the rollouts in flight are not saved,
and the first k steps after a resume sample with the resumed params).
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from rstar2_jax import chat
from rstar2_jax.algorithms import Algorithm, Rollouts, resolve_algorithm
from rstar2_jax.data.datasets import Problem, load_problems
from rstar2_jax.errors import ConfigError, MismatchError
from rstar2_jax.parallel.hosts import claims, deliver, gather, question_order, share as host_share
from rstar2_jax.model import load_hf
from rstar2_jax.rewards import VerifierPool
from rstar2_jax.parallel.roles import ServingCopy, rollout_mesh
from rstar2_jax.runtime import RolloutRuntime, score_rollouts
from rstar2_jax.sampler import AgentSampler, RolloutStopped, SamplingParams, Trajectory
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
    tool_status_counts,
    tool_status_metrics,
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


@dataclasses.dataclass(frozen=True)
class StepRollouts:
    """The sampler's side of one RL step, what the trainer needs of it.

    batch: `make_batch`'s arrays of this process's kept rollouts; None when nothing was kept.
    versions: int64 `[rollouts, 3]`: for each rollout the update trains on (every rollout when
      nothing was kept), its generated tokens' count, the sum of the policy versions that
      sampled them and the oldest of those versions.
    metrics: the step's rollout metrics (`rollout_metrics`, times).
    """

    step: int
    batch: dict | None
    versions: np.ndarray
    metrics: dict


def _per_question(trajs: list[Trajectory], n: int) -> dict[int, list[Trajectory]]:
    """This process's trajectories (`score_rollouts`: its questions in order, ``n`` each) by
    question."""
    ran = {trajs[i].prompt_index: trajs[i:i + n] for i in range(0, len(trajs), n)}
    if len(ran) * n != len(trajs) or any(t.prompt_index != q for q, ts in ran.items() for t in ts):
        raise RuntimeError("the sampler returned trajectories out of question order")
    return ran


def _rollout_numbers(ran: dict[int, list[Trajectory]], rewards: np.ndarray) -> dict[str, np.ndarray]:
    """Every number the step needs of the rollouts of the questions ``ran`` (question -> its
    trajectories), all but their tokens: ``question`` `[k]`, and `[k, n]` each: the `Rollouts`
    fields, the response lengths (tool output included) and, over each rollout's generated
    tokens, the sum and the oldest of the policy versions that sampled them; and
    ``tool_status`` `[k, n, statuses]` (`tool_status_counts`). ``rewards`` is `[questions, n]`."""
    questions = sorted(ran)
    trajs = [t for q in questions for t in ran[q]]
    shape = (len(questions), rewards.shape[1])
    versions = [np.asarray(t.versions, np.int64)[np.asarray(t.loss_mask, bool)] for t in trajs]
    return rollout_arrays(trajs, rewards[questions].reshape(shape))._asdict() | {
        "question": np.asarray(questions, np.int64),
        "response_length": np.array([len(t.response_ids) for t in trajs], np.int32).reshape(shape),
        "version_sum": np.array([v.sum() for v in versions], np.int64).reshape(shape),
        "version_min": np.array([v.min() for v in versions], np.int64).reshape(shape),
        "tool_status": tool_status_counts(trajs).reshape(*shape, -1)}


def _trained_versions(numbers: dict[str, np.ndarray], kept: np.ndarray) -> np.ndarray:
    """`StepRollouts.versions` of the rollouts ``kept`` (flat indices; all of them when empty)
    of the step's `_rollout_numbers`."""
    columns = [numbers[k].reshape(-1).astype(np.int64) for k in ("lengths", "version_sum", "version_min")]
    chosen = kept if kept.size else np.arange(columns[0].size)
    return np.stack([c[chosen] for c in columns], axis=1)


def _block_trajectories(ran: dict[int, list[Trajectory]], block: range) -> list[Trajectory]:
    """The trajectories of the questions in ``block`` (question-major), whichever process ran
    them: only they cross between processes (`hosts.deliver`), as records."""
    if jax.process_count() == 1:
        return [t for q in block for t in ran[q]]
    records = deliver({q: [t.record() for t in ts] for q, ts in ran.items()}, list(block))
    return [Trajectory.from_record(r) for question in records for r in question]


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
    copy: ServingCopy  # the trainer's params -> the sampler's
    checked_mismatch: bool = False  # the first update of this process's run checks the gap

    def step(self, state: TrainState, step: int, rng: jax.Array) -> tuple[TrainState, dict]:
        """One synchronous step (``rl.max_staleness=0``): rollouts of ``state``'s params, then
        the update. The trainer idles while the sampler runs and the sampler while the update
        runs: ``time/trainer_wait_s`` and ``time/sampler_wait_s`` say how long."""
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

    def rollout(self, params, step: int, rng: jax.Array, version: int,
                stop: threading.Event | None = None) -> StepRollouts:
        """The sampler's side of step ``step``: its rollouts by ``params`` (policy ``version``,
        stamped on every token), rewards, the algorithm's selection and the batch to train on.
        ``stop``: ends the rollouts early with `RolloutStopped` (`AgentSampler.rollout`)."""
        rl = self.config.rl
        n = rl.rollouts_per_question
        indices = question_batch(len(self.problems), rl.questions_per_step, step, self.config.seed)
        problems = [self.problems[i] for i in indices]
        prompts = [chat.encode_prompt(self.tokenizer, p.question, self.fmt) for p in problems]
        step_key = jax.random.fold_in(rng, step)
        rollout_seed = int(jax.random.randint(step_key, (), 0, 2**31 - 1))
        # Each host takes the step's questions from a shared queue as its rows free up
        # (rstar2_jax.parallel.hosts); a question draws the same rollouts whichever host takes it.
        # Nothing else scores with the run's verifier pool, so its counters' change over the
        # rollouts is this step's (a timed-out or failed verification scores 0 unseen otherwise).
        verifier_before = self.verifier.stats()
        trajs, rewards, stats, reward_wait = score_rollouts(
            self.sampler, self.verifier, params, problems, prompts, n, rollout_seed,
            claim=claims(len(problems)), version=version, stop=stop)
        verifier_after = self.verifier.stats()
        ran = _per_question(trajs, n)
        # Each process sends the others the numbers of its rollouts (the selection and the
        # metrics need every rollout's), and each rollout's tokens only to the process that
        # trains on it.
        numbers = gather(_rollout_numbers(ran, rewards))
        order = question_order(numbers["question"].tolist(), len(problems))
        numbers = {k: v[order] for k, v in numbers.items()}
        hosts = gather({
            "times": np.array([[stats.wall_s, stats.tool_wait_s, reward_wait]]),
            "counts": np.array([[stats.generated_tokens, stats.preemptions,
                                 verifier_after.timeouts - verifier_before.timeouts,
                                 verifier_after.errors - verifier_before.errors]], np.int64)})
        rollouts = Rollouts(**{k: numbers[k] for k in Rollouts._fields})
        kept = select_rollouts(self.algorithm, jax.random.fold_in(step_key, 1), rollouts,
                               rl.group_size)
        rollout_s, tool_wait_s, reward_wait_s = hosts["times"].max(axis=0)  # the slowest host's
        tokens, preemptions, verifier_timeouts, verifier_errors = hosts["counts"].sum(axis=0)
        metrics = rollout_metrics(rollouts, kept, numbers["response_length"].reshape(-1)) | {
            "time/rollout_s": rollout_s, "time/tool_wait_s": tool_wait_s,
            "time/reward_wait_s": reward_wait_s,
            "perf/rollout_tokens_per_s": tokens / max(rollout_s, 1e-9),
            "rollouts/preemptions": preemptions,
            "reward/verifier_timeouts": verifier_timeouts,
            "reward/verifier_errors": verifier_errors,
        } | tool_status_metrics(numbers["tool_status"])
        batch = None
        if kept.index.size:
            # Each process trains on the rollouts of its block of the step's questions, whichever
            # host sampled them: the update is the same whatever each host took.
            limits = self.config.limits
            share = host_share(len(indices))
            mine = kept.share(share.start * n, share.stop * n)
            block = _block_trajectories(ran, range(share.start, share.stop))
            most = int(np.bincount(kept.index // len(block)).max())  # kept rows of the fullest host
            # Packed, the model sees only the packed rows: the rollout layout the loss reads
            # takes the most rows a host can keep, so the update's shapes vary with the packed
            # row count alone (with both varying, each pair compiled: 221 programs in the demo).
            rows = len(block) if rl.packed else bucket(most, minimum=1)
            batch = make_batch(block, mine, pad_id=self.pad_id,
                               seq_len=limits.max_prompt_tokens + limits.max_response_tokens,
                               rows=rows)
            check_trained_ids(batch, block, mine, self._encode_tool_response)
        return StepRollouts(step=step, batch=batch, versions=_trained_versions(numbers, kept.index),
                            metrics=metrics)

    def train(self, state: TrainState, rollouts: StepRollouts) -> tuple[TrainState, dict]:
        """The trainer's side of step ``rollouts.step``: the update on its batch (none when the
        selection kept nothing), from ``state``, the policy after ``rollouts.step`` updates.
        Returns the new state and the step's metrics: the sampler side's, the update's and the
        staleness of the trained tokens (``staleness/mean``, ``staleness/max``: updates between
        the policy that sampled a token and the one that trains on it)."""
        step, metrics = rollouts.step, dict(rollouts.metrics)
        start = time.perf_counter()
        if rollouts.batch is not None:
            check = None if self.checked_mismatch else self._check_mismatch
            state, update_metrics = self.update(state, rollouts.batch, check=check)
            self.checked_mismatch = True
            metrics |= update_metrics
        else:
            log.warning("RL step %d: the selection kept no rollout to train on (every group's "
                        "rewards were equal); no update", step + 1)
        metrics["time/update_s"] = time.perf_counter() - start
        metrics["perf/update_tokens_per_s"] = metrics.get("tokens", 0.0) / metrics["time/update_s"]
        count, total, oldest = rollouts.versions.T
        metrics |= {"staleness/mean": float(step - total.sum() / count.sum()),
                    "staleness/max": float(step - oldest.min())}
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
    if config.rl.max_staleness and jax.process_count() > 1 and not config.mesh.rollout_devices:
        raise ConfigError(f"rl.max_staleness={config.rl.max_staleness} on several processes needs "
                          "mesh.rollout_devices > 0: each host's sampler runs on devices of its "
                          "own while the trainer's collectives run on the others "
                          "(docs/algorithms.md, \"Asynchronous RL\")")
    correction = config.rl.rollout_correction
    if config.rl.max_staleness and correction.weights == correction.mask == "none":
        # Measured on the toy testbed (docs/testbed.md, "Staleness"): k = 1 without a correction
        # collapsed on every seed, with token TIS two seeds of three learned as k = 0 did.
        log.warning("rl.max_staleness=%d without rl.rollout_correction: the update treats "
                    "rollouts from an older policy as on-policy (on the toy testbed k = 1 "
                    "collapsed this way on every seed); set rl.rollout_correction.weights=token",
                    config.rl.max_staleness)
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
            pad_id=tokenizer.pad_token_id or 0,
            copy=ServingCopy(run.model_config, run.mesh, rollout_mesh(config.mesh.rollout_devices),
                             config.rollout.serving_config(run.compute_config).jnp_dtype))
        if config.rl.max_staleness:
            _pipelined(loop, run, on_step, lag=config.rl.max_staleness)
        else:
            _synchronous(loop, run, on_step)
        return run.state
    finally:
        run.close()


def _synchronous(loop: RLLoop, run: Run, on_step: Callable[[int, dict], None] | None) -> None:
    """Runs the run's remaining steps one after the other (``rl.max_staleness=0``)."""
    since = time.perf_counter()
    for step in range(run.step, run.end_step):
        state, metrics = loop.step(run.state, step, run.rng)
        since = _log_step(run, state, metrics, on_step, since)


def _log_step(run: Run, state: TrainState, metrics: dict, on_step: Callable[[int, dict], None] | None,
              since: float) -> float:
    """Logs and checkpoints the step ``state`` ends, with ``time/step_s``: the wall time since
    ``since``, the previous step's logging (so a run's step times add up to its wall time).
    Returns the time this step was logged."""
    now = time.perf_counter()
    metrics["time/step_s"] = now - since
    run.finish_step(state, metrics, rng=run.rng, data_position={"step": int(state.step)})
    if on_step is not None:
        on_step(run.step, metrics)
    return now


def _pipelined(loop: RLLoop, run: Run, on_step: Callable[[int, dict], None] | None, *,
               lag: int) -> None:
    """Runs the run's remaining steps with rollouts ``lag`` (k) updates behind: a sampler thread
    rolls out step s with the policy after update max(start, s - k) (``start``: the step the
    run starts or resumes at) while this thread trains on earlier steps' rollouts.

    The bound holds by construction: the trainer publishes a copy of each version a later
    step samples with, in the serving dtype, on the sampler's devices (`RLLoop.copy`; the train
    step donates its own params), and the sampler waits for it, so it is at most k steps ahead
    and holds at most k + 1 versions; the trainer waits for each step's rollouts. The copy's
    time is the step's ``time/weight_copy_s``. Each side's waits are its step's
    ``time/trainer_wait_s`` / ``time/sampler_wait_s``. An exception on either side ends the
    run: the sampler's is raised here once the steps it finished are trained, with a note
    saying where it came from; the trainer's (a Ctrl-C included) stops the sampler before its
    next decode call, dropping the rollouts in flight, which a resume samples again.
    """
    start, end, since = run.step, run.end_step, time.perf_counter()
    partial = loop.config.rollout.on_weight_update != "finish"  # partial rollouts
    pipe = _Pipeline()
    pipe.publish(start, loop.copy(run.state.params))
    sampler = threading.Thread(target=_sample, args=(loop, pipe, run.rng, start, end, lag),
                               name="rl-sampler", daemon=True)
    sampler.start()
    try:
        for step in range(start, end):
            rollouts, waited = pipe.take(step)
            state, metrics = loop.train(run.state, rollouts)
            publish = step + 1 + lag < end  # step + 1 + k samples with this version
            post = partial and step + 1 < end  # the rollouts in flight go on with it
            copied = time.perf_counter()
            if publish or post:
                served = loop.copy(state.params)
                if publish:
                    pipe.publish(step + 1, served)
                if post:
                    loop.sampler.update_weights(served, step + 1)
            metrics["time/weight_copy_s"] = time.perf_counter() - copied
            metrics["time/trainer_wait_s"] = waited
            since = _log_step(run, state, metrics, on_step, since)
    finally:
        pipe.close()
        sampler.join()


def _sample(loop: RLLoop, pipe: _Pipeline, rng: jax.Array, start: int, end: int, lag: int) -> None:
    """The sampler thread of `_pipelined`: steps ``start .. end - 1`` in order."""
    step = start
    try:
        for step in range(start, end):
            version = max(start, step - lag)
            params, waited = pipe.params(version)
            rollouts = loop.rollout(params, step, rng, version, stop=pipe.stopped)
            del params  # the next step may serve a newer version; this one can go
            rollouts.metrics["time/sampler_wait_s"] = waited
            pipe.put(step, rollouts)
    except (_Stopped, RolloutStopped):
        pass
    except BaseException as e:  # noqa: BLE001 -- handed to the trainer, which raises it
        pipe.fail(step, e)


class _Stopped(Exception):
    """The trainer has stopped: the sampler thread ends."""


class _Pipeline:
    """What the trainer and the sampler thread of `_pipelined` hand each other: the params
    versions the sampler will serve, its finished steps, and the end of either side."""

    def __init__(self):
        self._changed = threading.Condition()
        self._params: dict[int, object] = {}
        self._ready: dict[int, StepRollouts] = {}
        self._failure: tuple[int, BaseException] | None = None
        self.stopped = threading.Event()  # set by the trainer when it stops

    def publish(self, version: int, params) -> None:
        """Trainer: ``params`` are policy ``version`` (a copy, ready, that the trainer will not
        donate)."""
        with self._changed:
            self._params[version] = params
            self._changed.notify_all()

    def params(self, version: int):
        """Sampler: (policy ``version``'s params, seconds waited for them); drops older
        versions. Raises _Stopped when the trainer has stopped."""
        start = time.perf_counter()
        with self._changed:
            self._changed.wait_for(lambda: self.stopped.is_set() or version in self._params)
            if self.stopped.is_set():
                raise _Stopped
            for old in [v for v in self._params if v < version]:
                del self._params[old]
            return self._params[version], time.perf_counter() - start

    def put(self, step: int, rollouts: StepRollouts) -> None:
        with self._changed:
            self._ready[step] = rollouts
            self._changed.notify_all()

    def fail(self, step: int, error: BaseException) -> None:
        """Sampler: ``error`` ended it while it prepared ``step``."""
        with self._changed:
            self._failure = step, error
            self._changed.notify_all()

    def take(self, step: int) -> tuple[StepRollouts, float]:
        """Trainer: (step ``step``'s rollouts, seconds waited for them); raises the sampler's
        exception if it failed before it finished them (the steps it finished train first)."""
        start = time.perf_counter()
        with self._changed:
            self._changed.wait_for(lambda: self._failure is not None or step in self._ready)
            if step not in self._ready:
                failed, error = self._failure
                error.add_note(f"(raised in the RL sampler thread, rolling out step {failed + 1}, "
                               f"rl.max_staleness > 0)")
                raise error
            return self._ready.pop(step), time.perf_counter() - start

    def close(self) -> None:
        """Trainer: it has stopped; the sampler ends at its next wait or decode call."""
        with self._changed:
            self.stopped.set()
            self._params.clear()
            self._changed.notify_all()
