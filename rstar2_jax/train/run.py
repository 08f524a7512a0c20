"""What every training loop does around its steps: set up, resume, log, checkpoint.

    run = start_run(run_dir=..., model=..., optimizer=..., total_steps=..., job_config=cfg)
    for step in range(run.step, run.end_step):
        state, metrics = train_step(run.state, batch)       # the loop's own work
        run.finish_step(state, metrics, rng=rng, data_position=position)
    run.close()

A run starts, in this order of preference, from (1) the newest readable checkpoint in its own
``run_dir`` (an exact resume), (2) the newest checkpoint of the run in ``init_from`` (the
previous stage of a staged recipe: params, and the optimizer state unless
``reset_optimizer``; the step count continues), (3) the Hugging Face checkpoint
``model.path``, its weights loaded in the dtype of ``precision.params`` (the master weights).
Checkpoints of (1) must be of the same kind of job and model, those of (2) of the same model
(`rstar2_jax.train.checkpoint.RunFingerprint`); the metrics file is cut back to the resumed
step only once the restore has succeeded.
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Callable

import jax
import optax

from rstar2_jax.config import config_to_dict
from rstar2_jax.errors import NonFiniteError
from rstar2_jax.model import ModelConfig, load_hf
from rstar2_jax.parallel.roles import split_devices
from rstar2_jax.parallel.sharding import make_mesh, param_specs, shard_params
from rstar2_jax.signals import SaveSignal, Stopped
from rstar2_jax.train.checkpoint import Checkpointer, RunFingerprint
from rstar2_jax.train.configs import (
    CheckpointConfig,
    MeshConfig,
    ModelSource,
    OptimizerConfig,
    PrecisionConfig,
)
from rstar2_jax.train.metrics import MetricsLogger
from rstar2_jax.train.optim import make_optimizer
from rstar2_jax.train.step import TrainState, init_train_state

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Run:
    """A started run. ``state``, ``rng`` and ``data_position`` are where the loop continues from;
    steps ``start_step + 1 .. end_step`` are this run's (``step`` is the last one done).
    ``model_config`` describes the params as stored (their dtype: the master weights'; what
    checkpoints and exports record); ``compute_config`` is the same model as the loss and the
    sampler run it (the precision policy's compute dtype and matmul precision)."""

    run_dir: Path
    mesh: jax.sharding.Mesh
    model_config: ModelConfig
    compute_config: ModelConfig
    param_specs: Any
    optimizer: optax.GradientTransformation
    state: TrainState
    rng: jax.Array
    data_position: Any
    start_step: int
    end_step: int
    checkpointer: Checkpointer
    logger: MetricsLogger | None  # process 0's; the others write nothing
    job_config: dict
    job: str  # the job config's class, recorded in each checkpoint
    save_signal: SaveSignal | None  # checkpoint.save_signal's
    max_nonfinite_steps: int
    nonfinite_steps: int = 0  # steps in a row, up to the last, with an update skipped
    nonfinite_since: int = 0  # the first of them
    # The policy versions the resumed checkpoint holds (start_run's read_versions): version ->
    # params in the serving dtype, laid out as the params; the loop takes them.
    versions: dict[int, Any] = dataclasses.field(default_factory=dict)

    @property
    def step(self) -> int:
        return int(self.state.step)

    def finish_step(self, state: TrainState, metrics: dict[str, float], *, rng: jax.Array,
                    data_position: Any,
                    versions: Callable[[], dict[int, Any]] | None = None) -> None:
        """Records the step just done: metrics (process 0 writes them), then a checkpoint (every
        process writes its shards) if due, at the last step, or when ``checkpoint.save_signal``
        came; after the last, raises `Stopped`. ``versions``, called only when a checkpoint is
        written, gives the policy versions it holds (`Checkpointer.save`). Counts the steps in a
        row whose update was skipped for a non-finite loss or gradient
        (``update/skipped_nonfinite``) and raises NonFiniteError at
        ``optimizer.max_nonfinite_steps``."""
        self.state, self.rng, self.data_position = state, rng, data_position
        step = int(state.step)
        if self.logger is not None:
            self.logger.log(step, metrics)
        if "update/skipped_nonfinite" in metrics:  # an RL step that kept nothing has no update
            skipped = metrics["update/skipped_nonfinite"] > 0
            if skipped and not self.nonfinite_steps:
                self.nonfinite_since = step
            self.nonfinite_steps = self.nonfinite_steps + 1 if skipped else 0
            if skipped:
                log.warning("step %d: the loss or gradient is not finite (loss %s, grad_norm %s); "
                            "its update was skipped (%d step(s) in a row; the run stops at %d)",
                            step, metrics.get("loss"), metrics.get("grad_norm"),
                            self.nonfinite_steps, self.max_nonfinite_steps)
        stop = self.save_signal is not None and step < self.end_step and self.save_signal.received()
        if self.checkpointer.due(step) or step == self.end_step or stop:
            self.checkpointer.save(state, rng=rng, model_config=self.model_config,
                                   job_config=self.job_config, job=self.job,
                                   data_position={"start_step": self.start_step, "data": data_position},
                                   versions=None if versions is None else versions())
        if self.nonfinite_steps >= self.max_nonfinite_steps:
            raise NonFiniteError(
                f"steps {self.nonfinite_since}-{step} of {self.run_dir}: the loss or gradient was not finite "
                f"(NaN or infinite) in {self.nonfinite_steps} steps in a row, and their updates "
                f"were skipped (optimizer.max_nonfinite_steps={self.max_nonfinite_steps}), so the "
                f"weights and checkpoints are finite: lower optimizer.lr, or check the data and "
                f"the weights of the loss, then resume")
        if stop:
            raise Stopped(self.save_signal.signum)

    def close(self) -> None:
        """Waits for the save in flight and closes the files; a Ctrl-C's unwinding included."""
        try:
            self.checkpointer.wait()
            self.checkpointer.close()
            if self.logger is not None:
                self.logger.close()
        finally:
            if self.save_signal is not None:  # still recorded while the save completes
                self.save_signal.close()


def start_run(*, run_dir: str | Path, model: ModelSource, optimizer: OptimizerConfig,
              total_steps: int, job_config: Any, seed: int = 0, mesh: MeshConfig = MeshConfig(),
              checkpoint: CheckpointConfig = CheckpointConfig(), init_from: str | None = None,
              reset_optimizer: bool = False, precision: PrecisionConfig = PrecisionConfig(),
              progress: bool = True, read_versions: bool = False) -> Run:
    """Builds the mesh (over the devices ``mesh.rollout_devices`` leaves to training), the
    sharded train state and the logger, resuming when possible.

    Args:
      total_steps: steps this run performs (the stage length), counted from its starting step.
      job_config: the job's config dataclass; saved in every checkpoint.
      init_from: run directory of the previous stage (used only if ``run_dir`` has no checkpoint).
      reset_optimizer: with ``init_from``, start from a fresh optimizer state.
      read_versions: a resume also reads the policy versions its checkpoint holds
        (`Run.versions`; asynchronous RL's).
    """
    run_dir = Path(run_dir)
    job_dict = config_to_dict(job_config)
    mesh_ = make_mesh(mesh.fsdp, mesh.tp, devices=split_devices(mesh.rollout_devices)[0])
    model_config, params = load_hf(model.path, dtype=precision.params)
    specs = param_specs(model_config, mesh_)
    opt = make_optimizer(optimizer, total_steps)
    state = init_train_state(shard_params(params, model_config, mesh_), opt, mesh=mesh_,
                             param_specs=specs)
    del params
    rng, data_position, start_step, versions = jax.random.key(seed), None, 0, {}

    checkpointer = Checkpointer(run_dir / "checkpoints", checkpoint)
    job = type(job_config).__name__
    restored = checkpointer.restore_latest(
        state, expect=RunFingerprint(job, model_config, model.path), read_versions=read_versions)
    if restored is not None:
        _warn_config_changes(restored.job_config, job_dict)
        state, rng, versions = restored.state, restored.rng, restored.versions
        start_step = restored.data_position["start_step"]
        data_position = restored.data_position["data"]
        log.info("resuming %s at step %d", run_dir, int(state.step))
    elif init_from is not None:
        previous = Checkpointer(Path(init_from) / "checkpoints")
        # The previous stage may be another kind of job (an SFT run); its model must be this one.
        restored = previous.restore_latest(state, params_only=reset_optimizer,
                                           expect=RunFingerprint(None, model_config, model.path))
        previous.close()
        if restored is None:
            raise FileNotFoundError(f"init_from={init_from!r} has no readable checkpoint")
        state = restored.state._replace(opt_state=state.opt_state) if reset_optimizer else restored.state
        start_step = int(state.step)
        log.info("starting from %s at step %d%s", init_from, start_step,
                 " with a fresh optimizer" if reset_optimizer else "")
    logger = None
    if jax.process_index() == 0:
        logger = MetricsLogger(run_dir, start_step=int(state.step),
                               total_steps=start_step + total_steps, progress=progress)
    save_signal = None if checkpoint.save_signal is None else SaveSignal(checkpoint.save_signal)
    return Run(run_dir, mesh_, model_config, precision.compute_config(model_config), specs, opt,
               state, rng, data_position, start_step, start_step + total_steps, checkpointer,
               logger, job_dict, job, save_signal, optimizer.max_nonfinite_steps,
               versions=versions)


def _warn_config_changes(saved: dict, current: dict, prefix: str = "") -> None:
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            _warn_config_changes(a, b, f"{prefix}{key}.")
        elif a != b:
            log.warning("resuming with %s%s=%r (the checkpoint was written with %r)", prefix, key, b, a)
