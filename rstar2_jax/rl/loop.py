"""The RL stage: set-up, then the steps (`rstar2_jax.rl.step`) driven one of two ways.

Synchronous (``rl.max_staleness=0``, the default, `_synchronous`): each step's rollouts come
from the params it trains; on one process without rollout devices the sampler reads the
trainer's params directly, no weight copy. Asynchronous (k > 0, `_pipelined`): a sampler thread
rolls out step s with the policy after update max(first, s - k) (first: the stage's first
step), from its own copy in the serving dtype, while the trainer updates on earlier steps
(docs/algorithms.md "Asynchronous RL"); with ``mesh.rollout_devices`` the two sides run on
disjoint devices and the copy goes device to device (`rstar2_jax.parallel.roles`). Both drivers
call the same two functions, `RLStep.rollout` (the sampler's side) and `RLStep.train` (the
trainer's).

The algorithm (`rstar2_jax.algorithms.Algorithm`) is a value: the one ``rl.algorithm`` names, or
one passed to `run_rl`. A resumed run repeats the uninterrupted one: under k > 0 the rollouts
in flight are not saved, but each checkpoint holds the k policy versions the next k steps
sample with, and the resume samples them again with those.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp

from rstar2_jax import chat
from rstar2_jax.algorithms import Algorithm, algorithm_spec, resolve_algorithm
from rstar2_jax.data.datasets import load_problems
from rstar2_jax.errors import ConfigError
from rstar2_jax.model import load_hf
from rstar2_jax.parallel.roles import ServingCopy, rollout_mesh
from rstar2_jax.rl.data import StepRollouts, check_algorithm
from rstar2_jax.rl.step import RLStep
from rstar2_jax.rl.update import RLUpdate, train_loss
from rstar2_jax.sampler import RolloutStopped, SamplingParams
from rstar2_jax.sampler.runtime import RolloutRuntime
from rstar2_jax.tokenizer import open_tokenizer
from rstar2_jax.train.checkpoint import Checkpointer
from rstar2_jax.train.configs import RLJobConfig
from rstar2_jax.train.run import Run, start_run
from rstar2_jax.train.step import TrainState

log = logging.getLogger(__name__)


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
    names. Given by value, the config the run saves names it (`algorithm_spec`: its registry
    name or import path) in place of ``rl.algorithm``. It is checked on a tiny made-up step
    before anything starts. `runtime` runs the
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
    elif (spec := algorithm_spec(algorithm)) is not None:
        config = dataclasses.replace(config, rl=dataclasses.replace(config.rl, algorithm=spec))
    else:
        log.warning("the algorithm given to run_rl has no name to record (not in the registry, "
                    "no module-level name): the run's saved config keeps rl.algorithm=%s, which "
                    "is not what trains", config.rl.algorithm)
    # The loss as the update will train with it: with the run's entropy bonus and KL penalty.
    check_algorithm(dataclasses.replace(algorithm, loss=train_loss(algorithm.loss, config.rl)),
                    config.rl.rollouts_per_question, config.rl.group_size,
                    questions=config.rl.questions_per_step,
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
                    progress=progress, read_versions=config.rl.max_staleness > 0)
    try:
        loop = RLStep(
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
        programs = compile_set(loop)
        log.info("RL steps compile at most %d programs, whatever each keeps: %s", sum(programs.values()),
                 ", ".join(f"{name} x{count}" for name, count in programs.items()))
        if config.rl.max_staleness:
            _pipelined(loop, run, on_step, lag=config.rl.max_staleness)
        else:
            _synchronous(loop, run, on_step)
        return run.state
    finally:
        run.close()


def compile_set(loop: RLStep) -> dict[str, int]:
    """The most programs the steps of ``loop``'s run compile, by JAX's names: the step's
    (`RLStep.programs`) and a checkpoint's fingerprints of the params, of the optimizer state
    and, at rl.max_staleness = k > 0, of the 1 to k policy versions it holds. Set up before the
    first step, the run has compiled the rest (the model's load, the optimizer state, the
    algorithm's check)."""
    return loop.programs() | {"jit(_fingerprints)": 2 + loop.config.rl.max_staleness}


def _synchronous(loop: RLStep, run: Run, on_step: Callable[[int, dict], None] | None) -> None:
    """Runs the run's remaining steps one after the other (``rl.max_staleness=0``)."""
    since = time.perf_counter()
    for step in range(run.step, run.end_step):
        state, metrics = loop(run.state, step, run.rng)
        since = _log_step(run, state, metrics, on_step, since)


def _log_step(run: Run, state: TrainState, metrics: dict, on_step: Callable[[int, dict], None] | None,
              since: float, versions: Callable[[], dict] | None = None) -> float:
    """Logs and checkpoints the step ``state`` ends, with ``time/step_s``: the wall time since
    ``since``, the previous step's logging (so a run's step times add up to its wall time).
    ``versions``: what a checkpoint holds of them (`Run.finish_step`). Returns the time this
    step was logged."""
    now = time.perf_counter()
    metrics["time/step_s"] = now - since
    run.finish_step(state, metrics, rng=run.rng, data_position={"step": int(state.step)},
                    versions=versions)
    if on_step is not None:
        on_step(run.step, metrics)
    return now


def _pipelined(loop: RLStep, run: Run, on_step: Callable[[int, dict], None] | None, *,
               lag: int) -> None:
    """Runs the run's remaining steps with rollouts ``lag`` (k) updates behind: a sampler thread
    rolls out step s with the policy after update max(first, s - k) (``first``: the stage's
    first step; the resume step when a resumed checkpoint lacks the versions,
    `_resumed_versions`) while this thread trains on earlier steps' rollouts.

    The bound holds by construction: the trainer publishes a copy of each version a later
    step samples with, in the serving dtype, on the sampler's devices (`RLStep.copy`; the train
    step donates its own params), and the sampler waits for it, so it is at most k steps ahead
    and holds at most k + 1 versions; the trainer waits for each step's rollouts. The copy's
    time is the step's ``time/weight_copy_s``. This thread keeps the copies of the versions
    the next k steps sample with (the sampler drops each once it has moved past it), and each
    checkpoint holds them (`ServingCopy.as_params`), so that a resume samples with them again.
    Each side's waits are its step's
    ``time/trainer_wait_s`` / ``time/sampler_wait_s``. An exception on either side ends the
    run: the sampler's is raised here once the steps it finished are trained, with a note
    saying where it came from; the trainer's (a Ctrl-C included) stops the sampler before its
    next decode call, dropping the rollouts in flight, which a resume samples again.
    """
    start, end, since = run.step, run.end_step, time.perf_counter()
    partial = loop.config.rollout.on_weight_update != "finish"  # partial rollouts
    first, served = _resumed_versions(loop, run, lag)  # version -> the sampler's copy
    served[start] = loop.copy(run.state.params)
    pipe = _Pipeline()
    for version, params in served.items():
        pipe.publish(version, params)
    sampler = threading.Thread(target=_sample, args=(loop, pipe, run.rng, start, end, lag, first),
                               name="rl-sampler", daemon=True)
    sampler.start()
    try:
        for step in range(start, end):
            rollouts, waited = pipe.take(step)
            state, metrics = loop.train(run.state, rollouts)
            served = {v: served[v] for v in _wanted(first, step + 1, end, lag)}
            kept = dict(served)  # what the checkpoint after this step holds
            publish = step + 1 + lag < end  # step + 1 + k samples with this version
            post = partial and step + 1 < end  # the rollouts in flight go on with it
            copied = time.perf_counter()
            if publish or post:
                copy = loop.copy(state.params)
                if publish:
                    pipe.publish(step + 1, copy)
                    served[step + 1] = copy
                if post:
                    loop.sampler.update_weights(copy, step + 1)
            metrics["time/weight_copy_s"] = time.perf_counter() - copied
            metrics["time/trainer_wait_s"] = waited
            since = _log_step(run, state, metrics, on_step, since,
                              versions=functools.partial(_saved, loop.copy, kept))
    finally:
        pipe.close()
        sampler.join()


def _resumed_versions(loop: RLStep, run: Run, lag: int) -> tuple[int, dict[int, object]]:
    """(the first version the run's steps sample with, the sampler's copies of the versions
    before ``run.step`` that steps ``run.step .. run.step + k - 1`` sample with): on a resume,
    the stage's first step and the checkpoint's versions; without them in the checkpoint, a
    warning, and the resume step and none (those steps sample with the resumed params)."""
    start, restored = run.step, run.versions
    run.versions = {}  # the copies replace them: training devices' memory
    wanted = _wanted(run.start_step, start, run.end_step, lag)
    if not wanted <= restored.keys():
        log.warning("checkpoint step %d holds no copy of policy version(s) %s, which steps %d-%d "
                    "sample with at rl.max_staleness=%d (a checkpoint of a finished stage, of an "
                    "older version of this program or of a run with a smaller rl.max_staleness): "
                    "they sample with the resumed params, and the run differs from here from one "
                    "that never stopped", start, ", ".join(map(str, sorted(wanted))), start + 1,
                    min(start + lag, run.end_step), lag)
        return start, {}
    return run.start_step, {v: loop.copy(restored[v]) for v in sorted(wanted)}


def _wanted(first: int, step: int, end: int, lag: int) -> set[int]:
    """The versions before ``step`` that steps ``step .. step + lag - 1`` (those before ``end``)
    sample with, the first of them ``first``."""
    return {max(first, s - lag) for s in range(step, min(step + lag, end))} - {step}


def _saved(copy: ServingCopy, versions: dict[int, object]) -> dict[int, object]:
    """The sampler's copies ``versions`` as a checkpoint holds them (`ServingCopy.as_params`)."""
    return {v: copy.as_params(params) for v, params in versions.items()}


def _sample(loop: RLStep, pipe: _Pipeline, rng: jax.Array, start: int, end: int, lag: int,
            first: int) -> None:
    """The sampler thread of `_pipelined`: steps ``start .. end - 1`` in order, step s with
    version max(first, s - lag)."""
    step = start
    try:
        for step in range(start, end):
            version = max(first, step - lag)
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
