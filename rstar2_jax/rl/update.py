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
and the loss see: each of them is the same function of the same arrays as unpacked.

Micro-batches have one shape for the whole run, whatever a step keeps: ``rl.micro_batch_size``
rows of ``seq`` tokens (packed: up to that many rows' segment slots of rollouts; unpacked: one
rollout a row), and a mini-batch takes as many as its rollouts fill (`micro_batches`). So the
update is six programs, compiled at its first step (`RLUpdate.describe`): the log-prob pass of
a micro-batch (one more with a reference policy), the step's statistics and rollout correction
on the layout above, a micro-batch's rows of that layout (`micro_batch_layout`), an empty
gradient accumulator, a micro-batch's gradient added to it, and the optimizer update. The
gradient program reads only its micro-batch: gathering its rows out of the whole sharded layout
in that program put collectives beside the model's layer loop that nothing ordered after the
loop, and on XLA:CPU's 8 devices of a 4 x 2 mesh some devices waited at the loop's all-reduce
while the others waited at the gather's collective-permute, until XLA ended the process.
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
)
from rstar2_jax.algorithms.algorithm import LossFn
from rstar2_jax.errors import ConfigError, MismatchError
from rstar2_jax.model import ModelConfig, target, token_logprobs
from rstar2_jax.parallel import hosts
from rstar2_jax.parallel.sharding import batch_spec, named_shardings, place_batch, process_fsdp_shards
from rstar2_jax.train.configs import RLConfig, RLJobConfig
from rstar2_jax.train.packing import Packing, PackShapes, gather_index, micro_batches, pack_tokens
from rstar2_jax.train.step import (Accumulator, TrainState, add_micro_batch, apply_update,
                                   metric_reduction, state_shardings, zero_accumulator)

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


def rl_loss(params: dict, mb: dict, *, model_config: ModelConfig, config: RLConfig, loss: LossFn):
    """``(loss_sum, count, metric_sums)`` of ``loss`` on a micro-batch of shifted rows (see
    :func:`_shift`) that also carry ``old_logp`` [rows, seq-1] (and, under a rollout
    correction, per-token ``advantages`` [rows, seq-1] and its narrowed ``mask``; with a
    reference, ``ref_logp`` [rows, seq-1]): the trainer's log-probs go to ``loss`` (`train_loss`
    of the algorithm's), with the inputs it declares, and its result is the train step's
    contract as it is."""
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


def _lengths(attention_mask):
    """Real tokens per right-padded row [rows] of attention_mask [rows, seq]."""
    return jnp.sum(attention_mask, axis=1, dtype=jnp.int32)


def micro_batch_rows(batch: dict, shapes: PackShapes, rows: int, mini_batches: int, *,
                     packed: bool) -> list[list[dict]]:
    """This process's rows of ``batch`` (`RLUpdate`'s input, padded) as the update's micro-batches:
    for each of the ``mini_batches`` mini-batches (rollouts j, j + n, ... of the layout), host
    arrays of its micro-batches, as many as its rollouts need (the most any process needs)
    and each of one shape: ``rows`` rows (this process's share) of ``shapes.max_tokens`` tokens,
    ``inputs`` and ``targets`` `[rows, seq - 1]`, and per sequence slot, ``index`` `[slots]`
    (the rollout's row in all processes' layout; past its end for an empty slot). Packed:
    ``segment_lengths`` `[rows, segments]` and ``gather`` `[slots, seq - 1]` (where each slot's
    values are in the micro-batch's packed ones, `_trainer_logprobs`), ``rows * segments``
    slots; unpacked: one rollout a row (``attention_mask`` `[rows, seq - 1]`; a row without
    one attends to itself), the rows its slots. A rollout with no loss token is left out."""
    layout_rows, seq = batch["tokens"].shape
    has_loss = batch["loss_mask"].any(axis=1)
    lengths = np.where(has_loss, batch["attention_mask"].sum(axis=1), 0)
    slots = rows * shapes.segments
    end, first_row = layout_rows * jax.process_count(), layout_rows * jax.process_index()
    plans = [micro_batches(lengths[j::mini_batches].tolist(), shapes, rows, slots)
             for j in range(mini_batches)]
    if jax.process_count() > 1:  # every process runs the most micro-batches any one needs
        most = hosts.gather(np.array([[len(p) for p in plans]]), channel="train").max(axis=0)
        empty = Packing(((),) * rows, shapes.max_tokens, shapes.segments)
        plans = [p + [empty] * (int(k) - len(p)) for p, k in zip(plans, most)]
    out = []
    for j, plan in enumerate(plans):
        members = np.arange(j, layout_rows, mini_batches)
        local = lengths[members].tolist()
        tokens = batch["tokens"][members]
        mini = []
        for packing in plan:
            order = [i for row in packing.rows for i in row]
            index = np.full(slots, end, np.int32)
            index[:len(order)] = first_row + members[order]
            rows_tokens = pack_tokens(tokens, local, packing, pad_id=0)
            mb = {"inputs": rows_tokens[:, :-1], "targets": rows_tokens[:, 1:], "index": index}
            if packed:
                gather = np.zeros((slots, seq - 1), np.int32)
                gather[:len(order)] = gather_index(packing, local, seq, first_row=jax.process_index() * rows,
                                                   order=order)
                mb |= {"segment_lengths": packing.segment_lengths(local), "gather": gather}
            else:
                used = np.array([local[row[0]] if row else seq for row in packing.rows])
                mb["attention_mask"] = (np.arange(seq - 1)[None] < used[:, None]).astype(np.int32)
            mini.append(mb)
        out.append(mini)
    return out


class RLUpdate:
    """``update(state, batch) -> (state, metrics)`` for one RL step; six programs for the run
    (module docstring), whatever the steps keep.

    ``loss`` is the algorithm's policy loss (`rstar2_jax.algorithms.Algorithm.loss`, resolved
    once, by `run_rl`). The update trains with `train_loss` of it: the run's entropy bonus and
    KL penalty added. ``reference``: the reference policy's params, laid out
    like ``params`` (any float dtype: the forward casts them to the compute dtype), exactly when
    ``config.reference``.

    Metrics: ``loss``, ``tokens`` (loss tokens of the step), ``grad_norm`` (mean over
    mini-batches), ``lr`` (last update), ``update/skipped_nonfinite`` (the step's updates
    skipped for a non-finite loss or gradient), ``entropy`` (of the policy before the update,
    nats/token), the sampler/trainer gap ``logprob_mismatch/*`` (``abs``, ``kl``,
    ``log_ppl_diff``, ``log_ppl_abs_diff``, ``ratio_max``, ``ratio_min``:
    `rstar2_jax.algorithms.mismatch_metrics`), what ``rl.rollout_correction`` did
    (``rollout_correction/*``: `rstar2_jax.algorithms.apply_correction`); and every metric of
    the loss (GRPO-RoC's: ``clip_low_frac``, ``clip_high_frac``, ``approx_kl``, ``ratio_mean``,
    ``ratio_max``), averaged as the loss averages (over the step's tokens or sequences),
    ``entropy_loss`` / ``kl_loss`` when ``rl.entropy_coef`` / ``rl.kl_coef`` is set.
    With a reference: ``ref_kl``, the k3 estimate of KL(policy || reference) before the update
    (nats/token, mean over the step's loss tokens).

    Its programs are attributes, jitted with the shardings ``__call__`` runs them with, so that
    a tool can compile exactly what a step runs (experiments/benchmarks/aot): ``logprob_pass``,
    ``step_statistics``, ``micro_batch_layout``, ``zero_accumulator``, ``add_micro_batch``,
    ``apply_update``; and a step's host-side layout: `prepare`, `host_micro_batches`,
    `gradient_inputs`, with the module's `step_layout` and `train_layout`.
    """

    def __init__(self, model_config: ModelConfig, config: RLConfig,
                 optimizer: optax.GradientTransformation, *, mesh: Mesh, param_specs: Any,
                 params: Any, loss: LossFn, reference: Any = None):
        self.model_config, self.config, self.mesh = model_config, config, mesh
        if (reference is not None) != config.reference:
            raise ValueError(f"rl.reference={config.reference}, and the update was given "
                             f"{'no' if reference is None else 'a'} reference policy")
        self._reference = reference
        fsdp = mesh.shape["fsdp"]
        # One row per data-parallel device by default: the memory of one rollout budget each.
        self.micro_rows = config.micro_batch_size or fsdp
        if self.micro_rows % fsdp:
            raise ValueError(f"rl.micro_batch_size={config.micro_batch_size} rows cannot be split "
                             f"over fsdp={fsdp} devices")
        rows = NamedSharding(mesh, batch_spec())
        params_sh = named_shardings(mesh, param_specs)
        replicated = NamedSharding(mesh, P())
        loss = functools.partial(rl_loss, model_config=model_config, config=config,
                                 loss=train_loss(loss, config))

        acc = Accumulator(params_sh, replicated, replicated, replicated)
        state = state_shardings(optimizer, params, mesh, param_specs)
        self.logprob_pass = jax.jit(self._logprob_pass, donate_argnums=1,
                                    in_shardings=(params_sh, rows, rows), out_shardings=rows)
        self.step_statistics = jax.jit(self._step_statistics, in_shardings=rows,
                                       out_shardings=(rows, rows, replicated))
        self.micro_batch_layout = jax.jit(micro_batch_layout, in_shardings=(rows, rows), out_shardings=rows)
        self.zero_accumulator = jax.jit(functools.partial(zero_accumulator, loss), out_shardings=acc)
        self.add_micro_batch = jax.jit(functools.partial(add_micro_batch, loss), donate_argnums=1,
                                       in_shardings=(params_sh, acc, rows), out_shardings=acc)
        self.apply_update = jax.jit(functools.partial(apply_update, optimizer), donate_argnums=0,
                                    in_shardings=(state, acc), out_shardings=(state, replicated))
        self._described = False

    def programs(self) -> dict[str, int]:
        """The update's programs, by JAX's names (module docstring): each compiled once."""
        return {"jit(_logprob_pass)": 1 + (self._reference is not None), "jit(_step_statistics)": 1,
                "jit(micro_batch_layout)": 1, "jit(zero_accumulator)": 1, "jit(add_micro_batch)": 1,
                "jit(apply_update)": 1}

    def describe(self, layout_rows: int, seq: int) -> str:
        """One line for the run's log: the update's programs and their shapes, for a layout of
        ``layout_rows`` rollout rows (all processes') of ``seq`` tokens."""
        shapes = self._pack_shapes(seq)
        slots = self.micro_rows * shapes.segments
        rows = f"{self.micro_rows} x {seq - 1} {'packed ' if self.config.packed else ''}rows"
        passes = "a log-prob pass" + (" and a reference pass" if self._reference is not None else "")
        return (f"RL update: {6 + (self._reference is not None)} programs whatever a step keeps: "
                f"{passes} of a micro-batch ({rows}, {slots} rollouts), the step's statistics on "
                f"its {layout_rows} x {seq - 1} rollout rows, a micro-batch's rows of them, an "
                f"empty gradient accumulator, a micro-batch's gradient, the optimizer update; "
                f"{self.config.mini_batches} "
                f"mini-batch(es) a step, each of the micro-batches its rollouts fill")

    def __call__(self, state: TrainState, batch: dict, *,
                 check: Callable[[dict[str, float]], None] | None = None,
                 ) -> tuple[TrainState, dict[str, float]]:
        """``batch``: this process's rows (all of them on one process), the same row count on
        every process; the update trains on all processes' rows. ``check``, if given, is called
        with the mismatch and correction metrics of the step (all processes' rows) before any
        optimizer step: it may raise to stop the run with the params untouched. The update's
        programs compile for the mesh's devices (their kernels: `rstar2_jax.model.target`)."""
        with target.compiling_for_mesh(self.mesh):
            return self._update(state, batch, check)

    def _update(self, state: TrainState, batch: dict, check) -> tuple[TrainState, dict[str, float]]:
        batch = self.prepare({k: np.asarray(batch[k]) for k in _FIELDS})
        layout_rows, seq = batch["tokens"].shape
        if not self._described:
            log.info(self.describe(layout_rows * jax.process_count(), seq))
            self._described = True
        plan = [[place_batch(mb, self.mesh) for mb in mini] for mini in self.host_micro_batches(batch)]
        layout = place_batch(step_layout(batch), self.mesh)
        ref_logp = None if self._reference is None else place_batch(
            {"logp": np.zeros((layout_rows, seq - 1), np.float32)}, self.mesh)
        for mb in (mb for mini in plan for mb in mini):
            layout |= self.logprob_pass(state.params, {k: layout[k] for k in ("old_logp", "entropy")}, mb)
            if ref_logp is not None:
                ref_logp = self.logprob_pass(self._reference, ref_logp, mb)
        if ref_logp is not None:
            layout["ref_logp"] = ref_logp["logp"]
        advantages, mask, stats = self.step_statistics(layout)
        stats = {k: float(v) for k, v in jax.device_get(stats).items()}
        tokens = stats.pop("tokens")  # of all processes
        if not tokens:
            raise ValueError("the batch has no generated token to train on")
        if check is not None:
            check(stats)
        train = train_layout(layout, advantages, mask)
        per_update = []
        for mini in plan:
            acc = None
            for mb in mini:
                mb = self.gradient_inputs(mb, train)
                if acc is None:
                    acc = self.zero_accumulator(state.params, mb)
                acc = self.add_micro_batch(state.params, acc, mb)
            state, metrics = self.apply_update(state, acc)
            per_update.append(jax.device_get(metrics))
        return state, _combine(per_update) | {"tokens": tokens} | stats

    def host_micro_batches(self, batch: dict) -> list[list[dict]]:
        """The micro-batches of ``batch`` (this process's rows, `prepare`d) as this
        update lays them out: `micro_batch_rows` at its micro-batch shape, host arrays per
        mini-batch."""
        return micro_batch_rows(batch, self._pack_shapes(batch["tokens"].shape[1]),
                                self.micro_rows * process_fsdp_shards(self.mesh) // self.mesh.shape["fsdp"],
                                self.config.mini_batches, packed=self.config.packed)

    def gradient_inputs(self, micro: dict, train: dict) -> dict:
        """A micro-batch (`host_micro_batches`, placed) as the gradient program takes it: its
        packed rows and its rows of the step's ``train`` layout (`train_layout`), those taken in
        a program of their own (module docstring)."""
        return {k: v for k, v in micro.items() if k != "index"} | self.micro_batch_layout(train, micro["index"])

    def _pack_shapes(self, seq: int) -> PackShapes:
        # Unpacked, a row holds one rollout: packing with one segment slot a row.
        return PackShapes(seq) if self.config.packed else PackShapes(seq, segments=1)

    def _logprob_pass(self, params, into: dict, micro: dict) -> dict:
        """``into`` (``old_logp`` and ``entropy``, or ``logp`` alone, `[rows, seq-1]` of the
        layout) with the values of ``params`` on ``micro``'s rollouts written in their rows."""
        if "entropy" in into:
            logp, entropy = _trainer_logprobs(params, micro, model_config=self.model_config,
                                              config=self.config, return_entropy=True)
            values = {"old_logp": logp, "entropy": entropy}
        else:
            values = {"logp": _trainer_logprobs(params, micro, model_config=self.model_config,
                                                config=self.config)}
        return {k: into[k].at[micro["index"]].set(values[k], mode="drop") for k in into}

    def _step_statistics(self, layout: dict):
        """``(advantages, mask, stats)`` of the step's layout: the advantages and loss mask as
        the rollout correction leaves them, and the step's statistics (``tokens``, its loss
        tokens, among them)."""
        logp, mask, sampler_logp = layout["old_logp"], layout["mask"], layout["sampler_logp"]
        advantages, loss_mask, corrected = apply_correction(
            self.config.rollout_correction, layout["advantages"], logp, sampler_logp, mask)
        tokens = jnp.sum(mask, dtype=jnp.int32)
        denom = jnp.maximum(tokens, 1)
        stats = ({"entropy": jnp.sum(jnp.where(mask, layout["entropy"], 0.0)) / denom, "tokens": tokens}
                 | mismatch_metrics(logp, sampler_logp, mask) | corrected)
        if "ref_logp" in layout:
            kl = kl_penalty(jnp.where(mask, logp, 0.0), jnp.where(mask, layout["ref_logp"], 0.0), "k3")
            stats["ref_kl"] = jnp.sum(kl) / denom
        return advantages, loss_mask, stats

    def prepare(self, batch: dict) -> dict:
        """``batch`` (host arrays, the module docstring's fields) checked, with rows of no loss
        appended so that they split evenly over this process's fsdp shards and the
        mini-batches; a ValueError names a malformed field."""
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
        # Rows split over this process's fsdp shards (place_batch) and into the mini-batches.
        pad = -rows % math.lcm(process_fsdp_shards(self.mesh), self.config.mini_batches)
        fill = {"tokens": 0, "attention_mask": 1, "loss_mask": 0, "advantages": 0.0, "sampler_logp": 0.0}
        return {k: np.concatenate([v, np.full((pad, *v.shape[1:]), fill[k], v.dtype)])
                for k, v in batch.items()}


def step_layout(batch: dict) -> dict:
    """The step's layout (host arrays, one rollout a row, `[rows, seq-1]` and ``advantages``
    `[rows]`) of a `RLUpdate.prepare`d ``batch`` before its log-prob passes: the loss ``mask``,
    ``sampler_logp`` and ``advantages``, and zeros where the passes write ``old_logp`` and
    ``entropy``."""
    shifted = _shift(batch)
    zeros = np.zeros(shifted["sampler_logp"].shape, np.float32)
    return ({k: shifted[k] for k in ("mask", "sampler_logp", "advantages")}
            | {"old_logp": zeros, "entropy": zeros})


def train_layout(layout: dict, advantages, mask) -> dict:
    """What the gradient programs read of the step's layout after its statistics: the old
    log-probs, the advantages and loss mask as the rollout correction leaves them
    (`RLUpdate.step_statistics`), and the reference's log-probs if the layout has them."""
    train = {"old_logp": layout["old_logp"], "advantages": advantages, "mask": mask}
    if "ref_logp" in layout:
        train["ref_logp"] = layout["ref_logp"]
    return train


def micro_batch_layout(layout: dict, index) -> dict:
    """A micro-batch's rows of the step's layout: row ``index[i]`` of each of ``layout``'s
    arrays in slot i (``index`` [slots], `micro_batch_rows`), zeros for an index past its end
    (an empty slot: no loss)."""
    return {k: jnp.take(v, index, axis=0, mode="fill", fill_value=0) for k, v in layout.items()}


def _combine(per_update: list[dict]) -> dict[str, float]:
    """The mini-batch updates' metrics as one: each weighted by its loss count (``tokens`` of
    the train step: loss tokens, or sequences, as the loss averages), maxima and minima of the
    names `metric_reduction` says, grad norm averaged, lr of the last, skipped updates counted."""
    counts = np.array([m["tokens"] for m in per_update], np.float64)
    total = max(counts.sum(), 1.0)
    out = {"lr": float(per_update[-1]["lr"]),
           "grad_norm": float(np.mean([m["grad_norm"] for m in per_update])),
           "update/skipped_nonfinite": float(sum(m["update/skipped_nonfinite"] for m in per_update))}
    for k in per_update[0].keys() - out.keys() - {"tokens"}:
        values = [float(m[k]) for m in per_update]
        how = metric_reduction(k)
        out[k] = {"max": max, "min": min}[how](values) if how != "mean" else float(np.dot(values, counts) / total)
    return out


def mismatch_check(config: RLJobConfig) -> Callable[[dict[str, float]], None]:
    """The first update's ``check`` (`RLUpdate.__call__`): stops the run (MismatchError) when
    the sampler's and the trainer's log-probs of its tokens disagree beyond
    ``rl.first_step_gap_limit``."""

    def check(stats: dict[str, float]) -> None:
        limit, gap = config.rl.first_step_gap_limit, stats["logprob_mismatch/log_ppl_abs_diff"]
        if limit is None or gap <= limit:
            return
        rl, rollout = config.rl, config.rollout
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

    return check
