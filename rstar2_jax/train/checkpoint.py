"""Orbax checkpoints that resume a run exactly, detect corruption, and export to Hugging Face.

A checkpoint at step s is a directory ``<run>/checkpoints/<s>/`` with three items:

    params     the params pytree (sharded arrays, written in parallel by every host)
    opt_state  the optimizer state
    meta       JSON: step, RNG key data, data position, the job (its config's class), the job
               config, the model config and a fingerprint of every array

and, in an asynchronous RL run's (``rl.max_staleness`` k > 0), a fourth:

    versions   the policy versions steps s .. s + k - 1 sample with (versions s - k .. s - 1:
               params in the serving dtype, laid out as the params), which a resume serves
               again so that it repeats the run that never stopped

Orbax writes each step to a temporary directory and renames it when complete, so a process
killed mid-save leaves no half-written step behind. That does not catch a finished checkpoint
whose files were later damaged: orbax happily reads a flipped bit back as a wrong weight. The
fingerprints do: restore recomputes them.

Before restoring, `Checkpointer.restore_latest` compares the checkpoint's job and model with the
resuming job's (`RunFingerprint`): another model or another kind of job stops with
`RunMismatchError`, nothing touched. A checkpoint proven damaged (a file missing, truncated or
undecodable, arrays that fail their fingerprints) is reported, moved aside to ``corrupt-<s>`` and
the previous step tried; any other failure to read (a filesystem or memory error) stops with
`CheckpointReadError`, nothing moved, since the checkpoint may well be sound.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from rstar2_jax import chat
from rstar2_jax.errors import ConfigError, ModelError, TokenizerError, require_writable_dir
from rstar2_jax.model import ModelConfig, param_shapes, save_hf
from rstar2_jax.model.hf import GENERATION_CONFIG
from rstar2_jax.tokenizer import check_tokenizer, load_tokenizer, tokenizer_files
from rstar2_jax.train.configs import CheckpointConfig
from rstar2_jax.train.step import TrainState

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Restored:
    """A train state and everything else needed to continue a run where it stopped."""

    state: TrainState
    rng: jax.Array  # a typed PRNG key
    data_position: Any  # JSON, as given to `save`
    job_config: dict
    model_config: ModelConfig
    versions: dict[int, Any] = dataclasses.field(default_factory=dict)  # read with read_versions


class CorruptCheckpointError(ModelError):
    """A checkpoint whose files cannot be read back exactly."""


class CheckpointDtypeError(ConfigError):
    """A sound checkpoint whose params are stored in another dtype than the run asks for."""


class RunMismatchError(ModelError):
    """Checkpoints written by another kind of job or for another model than the resuming job's."""


class CheckpointReadError(ModelError):
    """A checkpoint that could not be read for a reason that does not show it is damaged."""


@dataclasses.dataclass(frozen=True)
class RunFingerprint:
    """What a run's checkpoints must share with the job that continues from them: the job (its
    config's class, e.g. "RLJobConfig"; None: any) and the model's architecture (every field of
    its ModelConfig but the dtype, which `CheckpointDtypeError` reports). ``model_path`` only
    names the model in messages."""

    job: str | None
    model_config: ModelConfig
    model_path: str | None = None

    @classmethod
    def of(cls, meta: dict) -> "RunFingerprint":
        """The fingerprint a checkpoint's metadata records."""
        return cls(meta.get("job"), ModelConfig(**meta["model_config"]),
                   meta.get("job_config", {}).get("model", {}).get("path"))

    def check(self, saved: "RunFingerprint", where: str) -> None:
        """Raises RunMismatchError, naming both, unless checkpoints ``saved`` (those of ``where``)
        may be continued by the job this fingerprint describes."""
        if None not in (self.job, saved.job) and self.job != saved.job:
            raise RunMismatchError(f"{where} holds a run of another kind of job ({saved.job}, "
                                   f"this job is {self.job}): give this job a new run_dir")
        ours, theirs = (dataclasses.replace(c.model_config, dtype="float32") for c in (self, saved))
        if ours != theirs:
            differ = [f.name for f in dataclasses.fields(ModelConfig)
                      if getattr(ours, f.name) != getattr(theirs, f.name)]
            raise RunMismatchError(
                f"{where} holds a run of another model: "
                f"{', '.join(f'{k}={getattr(theirs, k)}' for k in differ)} "
                f"(model.path={saved.model_path}), and this job's model.path={self.model_path} has "
                f"{', '.join(f'{k}={getattr(ours, k)}' for k in differ)}: point model.path at the "
                f"model the run was trained from, or give this job a new run_dir")


# The TensorStore status codes (the start of its errors' messages) of a file that is missing,
# shorter than its index says or undecodable: the checkpoint's own damage. Other codes
# (UNAVAILABLE, RESOURCE_EXHAUSTED, UNKNOWN, ...) may be the filesystem's or the host's passing
# trouble.
_DAMAGE_CODES = ("NOT_FOUND:", "OUT_OF_RANGE:", "DATA_LOSS:", "FAILED_PRECONDITION:")


def _proven_damage(error: BaseException) -> bool:
    """Whether ``error`` (or an exception it was raised from) shows the checkpoint's files are
    damaged, rather than that reading them failed."""
    while error is not None:
        if isinstance(error, (CorruptCheckpointError, FileNotFoundError, json.JSONDecodeError)):
            return True
        if isinstance(error, ValueError) and str(error).startswith(_DAMAGE_CODES):
            return True
        error = error.__cause__ or error.__context__
    return False


@jax.jit
def _fingerprints(tree):
    """One uint32 per array: sum_i bits(x_i) * (2i + 1) mod 2**32.

    Integer addition is exact and order-free, so the value does not depend on how the array is
    sharded or reduced, and any single flipped bit changes it (an odd multiple of 2**k is never
    0 mod 2**32 for k < 32).
    """

    def one(x):
        x = jnp.asarray(x)
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        uint = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
        bits = jax.lax.bitcast_convert_type(x, uint).astype(jnp.uint32).reshape(-1)
        weights = 2 * jnp.arange(bits.size, dtype=jnp.uint32) + 1
        return jnp.sum(bits * weights, dtype=jnp.uint32)

    return jax.tree.map(one, tree)


def _fingerprint_dict(tree) -> dict[str, int]:
    # The leaves go in as a list: a tree keyed by version numbers ({"3": params}, then
    # {"5": params}) would otherwise be a new tree structure, and a new program, every save.
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    if not flat:
        return {}
    paths, leaves = zip(*flat)
    values = jax.device_get(_fingerprints(list(leaves)))
    return {jax.tree_util.keystr(path): int(v) for path, v in zip(paths, values, strict=True)}


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


class Checkpointer:
    """Saves and restores :class:`TrainState` plus run metadata under ``directory``."""

    def __init__(self, directory: str | Path, config: CheckpointConfig = CheckpointConfig()):
        self.directory = Path(directory).absolute()
        self.config = config
        self._manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=config.keep))

    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def due(self, step: int) -> bool:
        """Whether the periodic policy saves at ``step`` (the final step is saved regardless)."""
        return step % self.config.every == 0

    def save(self, state: TrainState, *, rng: jax.Array, data_position: Any, job_config: dict,
             model_config: ModelConfig, job: str | None = None,
             versions: dict[int, Any] | None = None) -> None:
        """Writes a checkpoint for ``state.step`` (asynchronously; see :meth:`wait`). ``job``:
        the job config's class, which a resume must match (`RunFingerprint`). ``versions``:
        policy version -> params (one dtype, laid out as ``state.params``), saved as the item
        ``versions`` when there are any."""
        step = int(state.step)
        items = {"params": state.params, "opt_state": state.opt_state}
        if versions:
            items["versions"] = {str(v): params for v, params in versions.items()}
        meta = {
            "step": step,
            "job": job,
            "rng": np.asarray(jax.random.key_data(rng)).tolist(),
            "rng_impl": str(jax.random.key_impl(rng)),
            "data_position": data_position,
            "job_config": job_config,
            "model_config": dataclasses.asdict(model_config),
            "fingerprints": {name: _fingerprint_dict(tree) for name, tree in items.items()},
        }
        if versions:
            meta["versions"] = {"numbers": sorted(versions),
                                "dtype": jnp.dtype(jax.tree.leaves(versions)[0].dtype).name}
        self._manager.save(step, force=True, args=ocp.args.Composite(
            meta=ocp.args.JsonSave(meta),
            **{name: ocp.args.StandardSave(tree) for name, tree in items.items()}))

    def restore_latest(self, like: TrainState, *, params_only: bool = False,
                       expect: RunFingerprint | None = None,
                       read_versions: bool = False) -> Restored | None:
        """The newest readable checkpoint, restored with the shapes and shardings of ``like``.

        ``like`` may hold arrays or ``jax.ShapeDtypeStruct``s with shardings. With
        ``params_only`` the optimizer state of ``like`` is kept (an optimizer reset). With
        ``read_versions``, the policy versions it holds too (`restore`).
        ``expect``: the resuming job's fingerprint; checkpoints of another job or model raise
        RunMismatchError before anything is read or moved. Checkpoints proven damaged are
        reported, moved to ``corrupt-<step>`` and skipped; CorruptCheckpointError when none is
        left. Any other failure to read one raises CheckpointReadError, nothing moved. Returns
        None if there is no checkpoint at all.
        """
        self.wait()
        steps = self.steps()
        for step in reversed(steps):
            try:
                if expect is not None:
                    expect.check(RunFingerprint.of(self.read_meta(step)),
                                 f"checkpoint step {step} in {self.directory}")
                return self.restore(step, like, params_only=params_only,
                                    read_versions=read_versions)
            except (RunMismatchError, CheckpointDtypeError):
                raise
            except Exception as e:  # noqa: BLE001 - sorted into damage and anything else
                reason = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                if not _proven_damage(e):
                    raise CheckpointReadError(
                        f"cannot read checkpoint step {step} in {self.directory} ({reason}); nothing "
                        f"was moved or changed: once the cause is fixed, run the same command again"
                    ) from e
                older = [s for s in self.steps() if s < step]
                fallback = f"falling back to step {older[-1]}" if older else "no older checkpoint left"
                log.warning("checkpoint step %d in %s is truncated or corrupt (%s); moved to "
                            "corrupt-%d, %s", step, self.directory, reason, step, fallback)
                self._quarantine(step)
        if steps:
            # Starting over would drop the run's metrics: leave that decision to the user.
            raise CorruptCheckpointError(
                f"every checkpoint in {self.directory} is damaged (steps {steps}, moved to "
                f"corrupt-<step>): to start the run over, remove {self.directory} (or give a new "
                f"run_dir)")
        return None

    def read_meta(self, step: int) -> dict:
        """The JSON metadata of checkpoint ``step``."""
        return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def restore(self, step: int, like: TrainState, *, params_only: bool = False,
                read_versions: bool = False) -> Restored:
        """Checkpoint ``step`` exactly (no fallback); raises if it is unreadable or damaged, and
        CheckpointDtypeError if its params are stored in another dtype than ``like``'s (orbax
        would convert them, and the converted arrays would then fail their fingerprints). With
        ``read_versions``, the policy versions it holds (none in most checkpoints) come back in
        ``Restored.versions``, in their saved dtype, laid out as ``like.params``."""
        meta = self.read_meta(step)
        saved = meta["model_config"]["dtype"]
        wanted = jax.tree.leaves(like.params)[0].dtype
        if jnp.dtype(saved) != wanted:
            raise CheckpointDtypeError(
                f"checkpoint step {step} in {self.directory} holds {saved} params, but this run "
                f"keeps them in {jnp.dtype(wanted).name} (precision.params): continue it with "
                f"precision.params={saved}, or export it and start a new run from the export")
        items = {"params": ocp.args.StandardRestore(_abstract(like.params)),
                 "meta": ocp.args.JsonRestore()}
        if not params_only:
            items["opt_state"] = ocp.args.StandardRestore(_abstract(like.opt_state))
        if read_versions and "versions" in meta:
            version = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
                x.shape, meta["versions"]["dtype"], sharding=x.sharding), like.params)
            items["versions"] = ocp.args.StandardRestore(
                {str(v): version for v in meta["versions"]["numbers"]})
        restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        meta = restored["meta"]
        if meta["step"] != step:
            raise CorruptCheckpointError(f"metadata says step {meta['step']}")
        for part in (name for name in items if name != "meta"):
            if _fingerprint_dict(restored[part]) != meta["fingerprints"][part]:
                raise CorruptCheckpointError(f"{part} do not match their fingerprints")
        opt_state = like.opt_state if params_only else restored["opt_state"]
        step_array = jax.device_put(np.int32(step), like.step.sharding)
        rng = jax.random.wrap_key_data(jnp.asarray(meta["rng"], jnp.uint32), impl=meta["rng_impl"])
        versions = {int(v): params for v, params in restored["versions"].items()} if (
            "versions" in items) else {}
        return Restored(TrainState(restored["params"], opt_state, step_array), rng,
                        meta["data_position"], meta["job_config"], ModelConfig(**meta["model_config"]),
                        versions)

    def _quarantine(self, step: int) -> None:
        if jax.process_index() == 0:
            source = self.directory / str(step)
            if source.exists():
                source.rename(self.directory / f"corrupt-{step}")
        self._manager.reload()

    def wait(self) -> None:
        """Blocks until pending asynchronous saves are on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()


def _open_checkpoints(checkpoint_dir: Path, step: int | None) -> tuple[Checkpointer, int]:
    """A checkpointer on an existing run's checkpoints (never created here) and the step to
    read: ``step``, or the newest. Raises ModelError naming the directory."""
    if not checkpoint_dir.is_dir():
        raise ModelError(f"checkpoint directory {checkpoint_dir} does not exist (give a run's "
                         f"<run_dir>/checkpoints)")
    checkpointer = Checkpointer(checkpoint_dir)
    steps = checkpointer.steps()
    if not steps or (step is not None and step not in steps):
        checkpointer.close()
        wanted = "no checkpoints" if not steps else f"no checkpoint for step {step} (have {steps})"
        raise ModelError(f"{wanted} in {checkpoint_dir} (give a run's <run_dir>/checkpoints)")
    return checkpointer, steps[-1] if step is None else step


def read_checkpoint_meta(checkpoint_dir: str | Path, step: int | None = None) -> dict:
    """The JSON metadata of checkpoint ``step`` (default: the newest) of a run's checkpoints."""
    checkpointer, step = _open_checkpoints(Path(checkpoint_dir), step)
    try:
        return checkpointer.read_meta(step)
    finally:
        checkpointer.close()


def restore_params(checkpoint_dir: str | Path, step: int | None = None) -> Restored:
    """The params (no optimizer state) of a run's checkpoint, on this process's first device:
    step ``step``, default the newest readable one. Raises ModelError naming the directory when
    it holds no (such, or no readable) checkpoint."""
    checkpointer, newest = _open_checkpoints(Path(checkpoint_dir), step)
    try:
        # The model config fixes the param shapes; it is the same in every step of a run.
        model_config = ModelConfig(**checkpointer.read_meta(newest)["model_config"])
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        params = jax.tree.map(
            lambda shape: jax.ShapeDtypeStruct(shape, model_config.jnp_dtype, sharding=device),
            param_shapes(model_config), is_leaf=lambda x: isinstance(x, tuple))
        like = TrainState(params, None, jax.ShapeDtypeStruct((), jnp.int32, sharding=device))
        if step is not None:
            return checkpointer.restore(step, like, params_only=True)
        return checkpointer.restore_latest(like, params_only=True)
    finally:
        checkpointer.close()


def export_hf(checkpoint_dir: str | Path, output_dir: str | Path, step: int | None = None,
              tokenizer: str | Path | None = None, dtype: str | None = None) -> int:
    """Writes a checkpoint (default: the newest readable one) as a complete Hugging Face model
    directory: config.json, generation_config.json, model.safetensors, and the tokenizer files
    (chat template included) of the model the run started from, so that the directory is the
    ``model.path`` of the next stage with nothing else to set. Returns the exported step.

    The tokenizer comes from the run's ``model.tokenizer`` (else ``model.path``), or from
    ``tokenizer`` when given; it is checked against the model before anything is written. The
    generation config is the starting model's when it has one.

    The weights are written in ``dtype`` ("float32" or "bfloat16"), by default in the dtype the
    run keeps its master weights in (``precision.params``: float32 unless set), which
    ``config.json``'s ``dtype`` then names; bfloat16 halves the files, as published checkpoints.
    """
    if dtype not in (None, "float32", "bfloat16"):
        raise ConfigError(f"export dtype must be float32 or bfloat16, got {dtype!r}")
    output_dir = Path(output_dir)
    meta = read_checkpoint_meta(checkpoint_dir, step)
    model_config = ModelConfig(**meta["model_config"])
    source = meta.get("job_config", {}).get("model", {})
    tokenizer_dir = tokenizer or source.get("tokenizer") or source.get("path")
    if tokenizer_dir is None:
        raise TokenizerError(f"the checkpoints in {checkpoint_dir} do not say which model the run "
                             f"started from; give the tokenizer's directory (export --tokenizer DIR)")
    try:
        check_tokenizer(load_tokenizer(tokenizer_dir), model_config, chat.ChatFormat(), tokenizer_dir)
    except TokenizerError as e:
        raise TokenizerError(f"{e} [export copies the tokenizer of the model the run started "
                             f"from; if it moved, pass --tokenizer DIR]") from None
    require_writable_dir(output_dir, "the export directory")
    restored = restore_params(checkpoint_dir, step)
    config, params = restored.model_config, restored.state.params
    if dtype is not None and dtype != config.dtype:
        config = dataclasses.replace(config, dtype=dtype)
        params = jax.tree.map(lambda x: x.astype(dtype), params)
    save_hf(output_dir, config, params)
    files = tokenizer_files(tokenizer_dir)
    if source.get("path") and (Path(source["path"]) / GENERATION_CONFIG).is_file():
        files.append(Path(source["path"]) / GENERATION_CONFIG)
    for file in files:
        shutil.copyfile(file, output_dir / file.name)
    return int(restored.state.step)
