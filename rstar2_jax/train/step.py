"""A generic sharded train step with exact token-mean gradient accumulation.

The step is parameterised by a loss function that returns *sums*, never means::

    loss_fn(params, micro_batch) -> (loss_sum, token_count, metric_sums)

so that summing over micro-batches and dividing once by the total token count gives exactly the
gradient of the token mean over the whole batch (not a mean of per-micro-batch means, which
would weight short micro-batches up). ``metric_sums`` are token-weighted sums too (e.g. the
number of clipped tokens) and come back as token means; the exception is a name ending in
``_max``, which is a maximum over micro-batches and comes back as is.

Sharding: params, and the optimizer moments that mirror them, follow the model's partition specs
on a ("fsdp", "tp") mesh; every batch array is split over "fsdp" on its leading (row) axis; the
scalar optimizer state is replicated.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from rstar2_jax.parallel.sharding import batch_spec, named_shardings
from rstar2_jax.train.optim import current_lr

LossFn = Callable[[Any, dict], tuple[jax.Array, jax.Array, dict[str, jax.Array]]]


class TrainState(NamedTuple):
    """Everything an update changes. ``step`` counts updates over the whole run (int32 [])."""

    params: Any
    opt_state: Any
    step: jax.Array


def state_shardings(optimizer: optax.GradientTransformation, params: Any, mesh: Mesh,
                    param_specs: Any) -> TrainState:
    """NamedShardings for a TrainState: params by ``param_specs``, optimizer moments like their
    params, everything else (counts, learning rate, step) replicated."""
    param_sh = named_shardings(mesh, param_specs)
    replicated = NamedSharding(mesh, P())
    abstract_opt = jax.eval_shape(optimizer.init, params)
    found = []

    def opt_shardings():
        # Traced, not run: tree_map_params calls the optimizer's init, which would otherwise
        # compile a program for each operation of its learning-rate schedule (and run it on
        # this process's default device, which a compile-only target, `rstar2_jax.model.target`,
        # is not).
        found.append(optax.tree_map_params(optimizer, lambda _, sh: sh, abstract_opt, param_sh,
                                           transform_non_params=lambda _: replicated))

    jax.eval_shape(opt_shardings)
    return TrainState(param_sh, found[0], replicated)


def init_train_state(params: Any, optimizer: optax.GradientTransformation, *,
                     mesh: Mesh | None = None, param_specs: Any = None, step: int = 0) -> TrainState:
    """A fresh optimizer state for ``params``, placed on ``mesh`` when given."""
    if mesh is None:
        return TrainState(params, optimizer.init(params), jnp.asarray(step, jnp.int32))
    shardings = state_shardings(optimizer, params, mesh, param_specs)
    params = jax.device_put(params, shardings.params)
    opt_state = jax.jit(optimizer.init, out_shardings=shardings.opt_state)(params)
    return TrainState(params, opt_state, jax.device_put(np.int32(step), shardings.step))


class Accumulator(NamedTuple):
    """Sums over the micro-batches of one update: float32 ``grads`` like the params, the loss
    sum, the loss's count and its metric sums (maxima and minima for the names
    `metric_reduction` says)."""

    grads: Any
    loss_sum: jax.Array
    count: jax.Array
    metrics: dict


def zero_accumulator(loss_fn: LossFn, params: Any, micro_batch: dict) -> Accumulator:
    """The empty sums of ``loss_fn``'s updates on micro-batches shaped like ``micro_batch``
    (arrays or abstract shapes)."""
    metric_zeros = {k: jnp.full(m.shape, _IDENTITY[metric_reduction(k)], jnp.float32)
                    for k, m in jax.eval_shape(loss_fn, params, micro_batch)[2].items()}
    return Accumulator(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
                       jnp.float32(0), jnp.float32(0), metric_zeros)


def add_micro_batch(loss_fn: LossFn, params: Any, acc: Accumulator, micro_batch: dict) -> Accumulator:
    """``acc`` plus the gradient, loss sum, count and metrics of ``loss_fn`` on ``micro_batch``."""
    def sum_loss(p):
        loss_sum, count, metrics = loss_fn(p, micro_batch)
        return loss_sum, (loss_sum, count, metrics)

    g, (loss_sum, count, metrics) = jax.grad(sum_loss, has_aux=True)(params)
    return Accumulator(jax.tree.map(lambda a, b: a + b.astype(jnp.float32), acc.grads, g),
                       acc.loss_sum + loss_sum, acc.count + count,
                       {k: _COMBINE[metric_reduction(k)](acc.metrics[k], metrics[k]) for k in acc.metrics})


def apply_update(optimizer: optax.GradientTransformation, state: TrainState,
                 acc: Accumulator) -> tuple[TrainState, dict]:
    """One optimizer update of ``state`` by the token-mean gradient of ``acc``, and its metrics
    (`make_train_step`'s); skipped (params and optimizer state as they were) when the loss or
    the gradient is not finite."""
    # An all-masked batch has no gradient; divide by 1 rather than produce NaNs.
    grads = jax.tree.map(lambda g: g / jnp.maximum(acc.count, 1.0), acc.grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    finite = jnp.isfinite(acc.loss_sum) & jnp.all(jnp.stack(
        [jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
    params, opt_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                                     (params, opt_state), (state.params, state.opt_state))
    denom = jnp.maximum(acc.count, 1.0)
    metrics = {name: value / denom if metric_reduction(name) == "mean" else value
               for name, value in acc.metrics.items()}
    metrics |= {"loss": acc.loss_sum / denom, "tokens": acc.count,
                "grad_norm": optax.tree.norm(grads), "lr": current_lr(opt_state),
                "update/skipped_nonfinite": 1.0 - finite.astype(jnp.float32)}
    return TrainState(params, opt_state, state.step + 1), metrics


def accumulate_gradients(loss_fn: LossFn, params: Any, batch: dict, micro_batches: int,
                         grad_shardings: Any = None):
    """Gradient of the token mean of ``loss_fn`` over ``batch``, in ``micro_batches`` passes.

    Micro-batch i takes rows i, i + n, i + 2n, ... (n = micro_batches) of every batch array.
    Striding rather than slicing keeps every micro-batch spread over all data-parallel devices:
    a contiguous slice of a row-sharded batch would live on only a few of them. Arrays may have
    different row counts (a packed batch's rows and its sequences), each a multiple of n.

    ``grad_shardings`` (NamedShardings like the params) pins the float32 gradient accumulator
    to the params' layout; left to itself the compiler may replicate it on every device.

    Returns:
      the `Accumulator` of the micro-batches' sums.
    """
    rows = {x.shape[0] for x in jax.tree.leaves(batch)}
    if any(n % micro_batches for n in rows):
        raise ValueError(f"batch of {sorted(rows)} rows does not split into {micro_batches} "
                         "micro-batches")

    def split(x):
        x = x.reshape(x.shape[0] // micro_batches, micro_batches, *x.shape[1:])
        return jnp.swapaxes(x, 0, 1)

    def constrain(acc):
        if grad_shardings is None:
            return acc
        return acc._replace(grads=jax.lax.with_sharding_constraint(acc.grads, grad_shardings))

    def body(acc, mb):
        return constrain(add_micro_batch(loss_fn, params, acc, mb)), None

    split_batch = jax.tree.map(split, batch)
    first = jax.tree.map(lambda x: x[0], split_batch)
    acc, _ = jax.lax.scan(body, constrain(zero_accumulator(loss_fn, params, first)), split_batch)
    return acc


def metric_reduction(name: str) -> str:
    """How a loss's metric ``name`` combines over micro-batches and mini-batches, by its suffix:
    ``_max``: "max" (the largest value of any of them), ``_min``: "min", any other name: "mean"
    (the loss returns a sum, divided by the loss's total count)."""
    return "max" if name.endswith("_max") else "min" if name.endswith("_min") else "mean"


_COMBINE = {"max": jnp.maximum, "min": jnp.minimum, "mean": jnp.add}
_IDENTITY = {"max": -jnp.inf, "min": jnp.inf, "mean": 0.0}


def make_train_step(loss_fn: LossFn, optimizer: optax.GradientTransformation, *,
                    micro_batches: int = 1, mesh: Mesh | None = None,
                    param_specs: Any = None, params: Any = None):
    """A jitted ``step(state, batch) -> (state, metrics)``; the input state is donated.

    Args:
      loss_fn: ``(params, micro_batch) -> (loss_sum, token_count, metric_sums)``.
      optimizer: from :func:`rstar2_jax.train.optim.make_optimizer`.
      micro_batches: forward/backward passes per update (activation memory / micro_batches).
      mesh, param_specs, params: shard the step; ``params`` (arrays or abstract shapes) give the
        optimizer-state structure. Without a mesh the step runs wherever its inputs live.

    A step whose loss or accumulated gradient (over all micro-batches and devices) holds a NaN
    or an infinity leaves the params and the optimizer state as they were (its count and the
    learning-rate schedule included): clipping does not stop a NaN, and AdamW would spread it
    to every weight. Only ``state.step`` advances; the caller decides when to give up.

    Metrics (float32 scalars): ``loss`` (token mean), ``tokens``, ``grad_norm`` (before
    clipping), ``lr`` (of this update), ``update/skipped_nonfinite`` (1 when the update was
    skipped, else 0), and each of ``loss_fn``'s metric sums divided by tokens, but for the
    maxima and minima that `metric_reduction` names by suffix.
    Rows are split over "fsdp" on a mesh, so the row count must be a multiple of
    ``micro_batches`` times the fsdp size (pad with all-masked rows).
    """
    if mesh is not None and (param_specs is None or params is None):
        raise ValueError("a sharded train step needs param_specs and params (or their shapes)")

    shardings = None if mesh is None else state_shardings(optimizer, params, mesh, param_specs)

    def step(state: TrainState, batch: dict):
        acc = accumulate_gradients(loss_fn, state.params, batch, micro_batches,
                                   None if shardings is None else shardings.params)
        return apply_update(optimizer, state, acc)

    if mesh is None:
        return jax.jit(step, donate_argnums=0)
    return jax.jit(step, in_shardings=(shardings, NamedSharding(mesh, batch_spec())),
                   out_shardings=(shardings, NamedSharding(mesh, P())), donate_argnums=0)
