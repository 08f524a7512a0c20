"""The RL optimizer update on a prepared batch of kept rollouts (after the algorithm's selection).

Input, one row per kept rollout, every per-token array aligned with ``tokens``::

    tokens          int32   [rows, seq]  prompt, generated and tool tokens, right-padded
    attention_mask  int32   [rows, seq]  1 on real tokens (a prefix of each row)
    loss_mask       int32   [rows, seq]  1 on tokens the model generated
    advantages      float32 [rows]       the rollout's advantage (from the algorithm)
    sampler_logp    float32 [rows, seq]  log-prob the sampler gave each generated token

The update (1) recomputes the old log-probs with the training forward, since the sampler's
numerics differ slightly from the trainer's and the ratio must start at exactly 1; their gap is
reported as the sampler/trainer mismatch, and ``rl.rollout_correction`` turns it into importance
weights on the advantages and a narrower loss mask (`rstar2_jax.algorithms.correction`); with
``rl.reference`` the same pass computes the reference policy's log-probs (a second forward with
the frozen reference weights); (2) splits the rows into ``mini_batches`` and takes one optimizer
step per mini-batch with the algorithm's policy loss, plus the run's entropy bonus and KL
penalty if any (`train_loss`), accumulated exactly over micro-batches. The loss gets the
per-token inputs it declares (`rstar2_jax.algorithms.loss_inputs`): ``entropy`` from its own
forward, with its gradient; ``ref_logp`` from step (1). With one mini-batch (the
released recipe) the ratio is 1 and nothing is clipped; with more, later mini-batches see a
moved policy and clipping starts to act.

Packed (``rl.packed``, the default): the rows go to the model packed, several rollouts per row
(`rstar2_jax.train.packing`), and the per-token log-probs (and entropies) come back gathered
into the layout above, one rollout per row, which is what the rollout correction, the metrics
and the loss see: each of them is the same function of the same arrays as unpacked. Each mini-
and micro-batch packs its own rollouts (packing groups), the ones it would train on unpacked.

Every distinct (rows, seq) shape compiles once; bucket them in the caller. Packed shapes are
`PackShapes`' (logged at the first update).
"""
from __future__ import annotations

import functools
import logging
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from rstar2_jax.algorithms import (
    apply_correction,
    kl_penalty,
    loss_inputs,
    mismatch_metrics,
    regularized,
    resolve_algorithm,
)
from rstar2_jax.algorithms.algorithm import LossFn
from rstar2_jax.errors import ConfigError
from rstar2_jax.model import ModelConfig, token_logprobs
from rstar2_jax.parallel.sharding import batch_spec, named_shardings, place_batch, process_fsdp_shards
from rstar2_jax.train.configs import RLConfig
from rstar2_jax.train.packing import PackShapes, gather_index, pack_across_processes, pack_tokens
from rstar2_jax.train.step import TrainState, make_train_step, metric_reduction

log = logging.getLogger(__name__)

_FIELDS = ("tokens", "attention_mask", "loss_mask", "advantages", "sampler_logp")


def _shift(batch: dict) -> dict:
    """Position t predicts token t + 1: inputs/targets and every per-target array, [rows, seq-1]."""
    return {"inputs": batch["tokens"][:, :-1], "targets": batch["tokens"][:, 1:],
            "attention_mask": batch["attention_mask"][:, :-1],
            "mask": batch["loss_mask"][:, 1:].astype(bool),
            "sampler_logp": batch["sampler_logp"][:, 1:],
            "advantages": batch["advantages"]}


def train_loss(loss: LossFn, config: RLConfig) -> LossFn:
    """The loss a run trains with: the algorithm's ``loss`` plus the run's entropy bonus and KL
    penalty (`rstar2_jax.algorithms.regularized`; ``loss`` itself when both are off). Raises
    ConfigError when they cannot be added to it, or when it takes reference log-probs and the
    run has no reference."""
    try:
        loss = regularized(loss, entropy_coef=config.entropy_coef, kl_coef=config.kl_coef,
                           kl_penalty=config.kl_penalty)
    except ValueError as e:
        raise ConfigError(f"rl.entropy_coef={config.entropy_coef}, rl.kl_coef={config.kl_coef}: {e}") from None
    if "ref_logp" in loss_inputs(loss) and not config.reference:
        raise ConfigError("the algorithm's loss takes ref_logp, the reference policy's log-probs, "
                          "and the run has no reference policy: set rl.reference=true")
    return loss


def rl_loss(params: dict, mb: dict, *, model_config: ModelConfig, config: RLConfig,
            loss: LossFn | None = None):
    """``(loss_sum, count, metric_sums)`` of ``loss`` on a micro-batch of shifted rows (see
    :func:`_shift`) that also carry ``old_logp`` [rows, seq-1] (and, under a rollout
    correction, per-token ``advantages`` [rows, seq-1] and its narrowed ``mask``; with a
    reference, ``ref_logp`` [rows, seq-1]): the trainer's log-probs go to ``loss`` (default:
    `train_loss` of the loss of the algorithm ``config.algorithm`` names), with the inputs it
    declares, and its result is the train step's contract as it is."""
    if loss is None:
        loss = train_loss(resolve_algorithm(config.algorithm).loss, config)
    inputs = loss_inputs(loss)
    out = _trainer_logprobs(params, mb, model_config=model_config, config=config,
                            remat=config.remat, return_entropy="entropy" in inputs)
    logp, extra = (out[0], {"entropy": out[1]}) if "entropy" in inputs else (out, {})
    if "ref_logp" in inputs:
        extra["ref_logp"] = mb["ref_logp"]
    return loss(logp, mb["old_logp"], mb["advantages"], mb["mask"], **extra)


def _trainer_logprobs(params, rows: dict, *, model_config: ModelConfig, config: RLConfig, **kwargs):
    """`token_logprobs` of shifted rows (`_shift`), one sequence per row `[rows, seq-1]`: of
    right-padded rows by their lengths, or of packed rows (``segment_lengths``), gathered back
    to that layout by ``gather`` (`rstar2_jax.train.packing.gather_index`)."""
    kwargs |= {"chunk_size": config.logprob_chunk, "temperature": config.temperature}
    if "segment_lengths" not in rows:
        return token_logprobs(params, model_config, rows["inputs"], rows["targets"],
                              lengths=_lengths(rows["attention_mask"]), **kwargs)
    packed = token_logprobs(params, model_config, rows["inputs"], rows["targets"],
                            segment_lengths=rows["segment_lengths"], **kwargs)
    return jax.tree.map(lambda x: x.reshape(-1)[rows["gather"]], packed)


def _old_logprobs(params, shifted, *, model_config: ModelConfig, config: RLConfig, chunks: int,
                  return_entropy: bool = True):
    """Trainer log-probs [rows, seq-1] and, with ``return_entropy``, entropies (no gradient),
    ``chunks`` row chunks at a time (strided, like the train step's micro-batches; packed rows
    and their gather index alike)."""
    def split(x):
        return jnp.swapaxes(x.reshape(x.shape[0] // chunks, chunks, *x.shape[1:]), 0, 1)

    def merge(x):
        return jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:])

    def one(rows):
        return _trainer_logprobs(params, rows, model_config=model_config, config=config,
                                 return_entropy=return_entropy)

    keys = [k for k in ("inputs", "targets", "attention_mask", "segment_lengths", "gather") if k in shifted]
    return jax.tree.map(merge, jax.lax.map(one, {k: split(shifted[k]) for k in keys}))


def _lengths(attention_mask):
    """Real tokens per right-padded row [rows] of attention_mask [rows, seq]."""
    return jnp.sum(attention_mask, axis=1, dtype=jnp.int32)


def pack_rows(batch: dict, shifted: dict, shapes: PackShapes, groups: int) -> dict:
    """``shifted`` (`_shift` of ``batch``, this process's rows) with its token rows packed
    (``inputs``, ``targets``, ``segment_lengths``) and the ``gather`` index of each rollout's
    values in them (`_trainer_logprobs`); the per-target arrays stay one rollout per row.
    Rollout i is in packing group i % ``groups`` (the step's mini- and micro-batches take every
    ``groups``-th row). A rollout with no loss token (a padding row) is left out of the rows."""
    seq = batch["tokens"].shape[1]
    has_loss = batch["loss_mask"].any(axis=1)
    lengths = np.where(has_loss, batch["attention_mask"].sum(axis=1), 0).tolist()
    packing = pack_across_processes(lengths, shapes, groups)
    rows = pack_tokens(batch["tokens"], lengths, packing, pad_id=0)
    first_row = jax.process_index() * len(packing.rows) // groups  # rows placed before ours
    packed = {"inputs": rows[:, :-1], "targets": rows[:, 1:],
              "segment_lengths": packing.segment_lengths(lengths),
              "gather": gather_index(packing, lengths, seq, groups, first_row)}
    return {k: v for k, v in shifted.items() if k not in ("inputs", "targets", "attention_mask")} | packed


class RLUpdate:
    """``update(state, batch) -> (state, metrics)`` for one RL step; compiled once per shape.

    ``loss`` is the algorithm's policy loss (`rstar2_jax.algorithms.Algorithm.loss`); by default
    the one ``config.algorithm`` names. The update trains with `train_loss` of it: the run's
    entropy bonus and KL penalty added. ``reference``: the reference policy's params, laid out
    like ``params`` (any float dtype: the forward casts them to the compute dtype), exactly when
    ``config.reference``.

    Metrics: ``loss``, ``tokens`` (loss tokens of the step), ``grad_norm`` (mean over
    mini-batches), ``lr`` (last update), ``entropy`` (of the policy before the update,
    nats/token), the sampler/trainer gap ``logprob_mismatch/*`` (``abs``, ``kl``,
    ``log_ppl_diff``, ``log_ppl_abs_diff``, ``ratio_max``, ``ratio_min``:
    `rstar2_jax.algorithms.mismatch_metrics`), what ``rl.rollout_correction`` did
    (``rollout_correction/*``: `rstar2_jax.algorithms.apply_correction`); and every metric of
    the loss (GRPO-RoC's: ``clip_low_frac``, ``clip_high_frac``, ``approx_kl``, ``ratio_mean``,
    ``ratio_max``), averaged as the loss averages (over the step's tokens or sequences),
    ``entropy_loss`` / ``kl_loss`` among them when ``rl.entropy_coef`` / ``rl.kl_coef`` is set.
    With a reference: ``ref_kl``, the k3 estimate of KL(policy || reference) before the update
    (nats/token, mean over the step's loss tokens).
    """

    def __init__(self, model_config: ModelConfig, config: RLConfig,
                 optimizer: optax.GradientTransformation, *, mesh: Mesh, param_specs: Any,
                 params: Any, loss: LossFn | None = None, reference: Any = None):
        self.model_config, self.config, self.mesh = model_config, config, mesh
        if (reference is not None) != config.reference:
            raise ValueError(f"rl.reference={config.reference}, and the update was given "
                             f"{'no' if reference is None else 'a'} reference policy")
        self._reference = reference
        self._fsdp = mesh.shape["fsdp"]
        if config.micro_batch_size is not None and config.micro_batch_size % self._fsdp:
            raise ValueError(f"rl.micro_batch_size={config.micro_batch_size} rows cannot be split "
                             f"over fsdp={self._fsdp} devices")
        self._rows = NamedSharding(mesh, batch_spec())
        self._param_shardings = named_shardings(mesh, param_specs)
        loss = train_loss(resolve_algorithm(config.algorithm).loss if loss is None else loss, config)
        loss = functools.partial(rl_loss, model_config=model_config, config=config, loss=loss)
        self._steps = {}  # micro-batches per update -> jitted train step
        self._old_passes = {}  # row chunks -> jitted old log-prob pass
        self._make_step = lambda micro: make_train_step(
            loss, optimizer, micro_batches=micro, mesh=mesh, param_specs=param_specs, params=params)
        # Mini-batch j: rows j, j + n, ... (n = mini_batches); strided, so balanced over devices.
        self._mini_batch = jax.jit(
            lambda rows, j: jax.tree.map(lambda x: x[j::config.mini_batches], rows),
            static_argnums=1, out_shardings=self._rows)
        self._logged_shapes = False

    def row_multiple(self) -> int:
        """Row counts of all processes together are padded up to a multiple of this (with rows
        that carry no loss token)."""
        per_update = self.config.micro_batch_size or self._fsdp
        return self.config.mini_batches * per_update

    def __call__(self, state: TrainState, batch: dict, *,
                 check: Callable[[dict[str, float]], None] | None = None,
                 ) -> tuple[TrainState, dict[str, float]]:
        """``batch``: this process's rows (all of them on one process), the same row count on
        every process; the update trains on all processes' rows. ``check``, if given, is called
        with the mismatch and correction metrics of the step (all processes' rows) before any
        optimizer step: it may raise to stop the run with the params untouched."""
        batch = self._check_and_pad({k: np.asarray(batch[k]) for k in _FIELDS})
        rows = batch["tokens"].shape[0] * jax.process_count()
        rows_per_update = rows // self.config.mini_batches
        micro = rows_per_update // (self.config.micro_batch_size or rows_per_update)
        shifted = _shift(batch)
        if self.config.packed:
            shifted = self._pack(batch, shifted, groups=micro * self.config.mini_batches)
        shifted = place_batch(shifted, self.mesh)
        tokens = float(_count(shifted["mask"]))  # of all processes
        if not tokens:
            raise ValueError("the batch has no generated token to train on")

        chunks = micro * self.config.mini_batches
        if chunks not in self._old_passes:
            self._old_passes[chunks] = self._old_pass(chunks)
        old_logp, ref_logp, advantages, mask, stats = self._old_passes[chunks](
            state.params, self._reference, shifted)
        stats = {k: float(v) for k, v in jax.device_get(stats).items()}
        if check is not None:
            check(stats)
        if micro not in self._steps:
            self._steps[micro] = self._make_step(micro)
        step_fn = self._steps[micro]
        per_update = []
        update_rows = {k: v for k, v in shifted.items() if k != "sampler_logp"}
        update_rows |= {"old_logp": old_logp, "advantages": advantages, "mask": mask}
        if ref_logp is not None:
            update_rows["ref_logp"] = ref_logp
        for j in range(self.config.mini_batches):
            state, metrics = step_fn(state, self._mini_batch(update_rows, j))
            per_update.append(jax.device_get(metrics))
        return state, _combine(per_update) | {"tokens": tokens} | stats

    def _pack(self, batch: dict, shifted: dict, groups: int) -> dict:
        shapes = PackShapes(batch["tokens"].shape[1], row_multiple=process_fsdp_shards(self.mesh))
        if not self._logged_shapes:
            log.info("RL update %s", shapes.describe(batch["tokens"].shape[0], groups))
            self._logged_shapes = True
        return pack_rows(batch, shifted, shapes, groups)

    def _old_pass(self, chunks: int):
        """Jitted ``(params, reference, shifted) -> (old_logp, ref_logp, advantages, mask,
        stats)``: the trainer's log-probs of the step's tokens, the reference's (None without
        one), the advantages and loss mask as the rollout correction leaves them, and the step's
        statistics."""
        def run(params, reference, shifted):
            logp, entropy = _old_logprobs(params, shifted, model_config=self.model_config,
                                          config=self.config, chunks=chunks)
            mask, sampler_logp = shifted["mask"], shifted["sampler_logp"]
            advantages, loss_mask, corrected = apply_correction(
                self.config.rollout_correction, shifted["advantages"], logp, sampler_logp, mask)
            tokens = jnp.maximum(jnp.sum(mask), 1)
            stats = ({"entropy": jnp.sum(jnp.where(mask, entropy, 0.0)) / tokens}
                     | mismatch_metrics(logp, sampler_logp, mask) | corrected)
            ref_logp = None
            if reference is not None:
                # Log-probs only: the reference's entropy is of no use.
                ref_logp = _old_logprobs(reference, shifted, model_config=self.model_config,
                                         config=self.config, chunks=chunks, return_entropy=False)
                kl = kl_penalty(jnp.where(mask, logp, 0.0), jnp.where(mask, ref_logp, 0.0), "k3")
                stats["ref_kl"] = jnp.sum(kl) / tokens
            return logp, ref_logp, advantages, loss_mask, stats

        references = None if self._reference is None else self._param_shardings
        return jax.jit(run, in_shardings=(self._param_shardings, references, self._rows),
                       out_shardings=(self._rows, None if references is None else self._rows,
                                      self._rows, self._rows, NamedSharding(self.mesh, P())))

    def _check_and_pad(self, batch: dict) -> dict:
        rows, seq = batch["tokens"].shape
        for k in ("attention_mask", "loss_mask", "sampler_logp"):
            if batch[k].shape != (rows, seq):
                raise ValueError(f"{k} must be [rows, seq] = {(rows, seq)}, got {batch[k].shape}")
        if batch["advantages"].shape != (rows,):
            raise ValueError(f"advantages must be [rows] = ({rows},), got {batch['advantages'].shape}")
        if np.any(batch["loss_mask"].astype(bool) & ~batch["attention_mask"].astype(bool)):
            raise ValueError("loss_mask marks padding tokens (attention_mask 0)")
        real = batch["attention_mask"].astype(bool)
        if np.any(real[:, 1:] & ~real[:, :-1]):
            raise ValueError("attention_mask must be 1 on a prefix of each row (right padding): "
                             "the update attends by row lengths")
        # Each process pads its rows alike: to a multiple of its fsdp shards (place_batch) that
        # makes all processes' rows together a multiple of row_multiple.
        total, processes = self.row_multiple(), jax.process_count()
        pad = -rows % math.lcm(process_fsdp_shards(self.mesh), total // math.gcd(total, processes))
        # Padding rows attend to themselves (an all-zero attention row would give NaN logits,
        # and NaN * 0 is NaN in the backward pass) but carry no loss token.
        fill = {"tokens": 0, "attention_mask": 1, "loss_mask": 0, "advantages": 0.0, "sampler_logp": 0.0}
        return {k: np.concatenate([v, np.full((pad, *v.shape[1:]), fill[k], v.dtype)])
                for k, v in batch.items()}


@jax.jit
def _count(mask: jax.Array) -> jax.Array:
    return jnp.sum(mask, dtype=jnp.int32)


def _combine(per_update: list[dict]) -> dict[str, float]:
    """The mini-batch updates' metrics as one: each weighted by its loss count (``tokens`` of
    the train step: loss tokens, or sequences, as the loss averages), maxima and minima of the
    names `metric_reduction` says, grad norm averaged, lr of the last."""
    counts = np.array([m["tokens"] for m in per_update], np.float64)
    total = max(counts.sum(), 1.0)
    out = {"lr": float(per_update[-1]["lr"]),
           "grad_norm": float(np.mean([m["grad_norm"] for m in per_update]))}
    for k in per_update[0].keys() - {"lr", "grad_norm", "tokens"}:
        values = [float(m[k]) for m in per_update]
        how = metric_reduction(k)
        out[k] = {"max": max, "min": min}[how](values) if how != "mean" else float(np.dot(values, counts) / total)
    return out
