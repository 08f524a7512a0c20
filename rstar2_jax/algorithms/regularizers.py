"""The two standard extra terms of a policy loss, an entropy bonus and a KL penalty to a reference
policy, as options of any algorithm (``rl.entropy_coef``, ``rl.kl_coef``, ``rl.kl_penalty``).

`regularized` wraps an `Algorithm.loss` and adds, per (micro-)batch, with the loss's own
aggregation mode (`rstar2_jax.algorithms.loss.aggregate`), so accumulation over micro-batches
stays exact and the terms weigh tokens exactly as the loss does:

    loss = policy loss - entropy_coef * agg(H_t) + kl_coef * agg(kl_t)

H_t is the entropy (nats) of the policy's next-token distribution at loss token t, kl_t the
per-token estimate `kl_penalty` of KL(policy || reference) from the sampled token. These are
verl's actor terms (``entropy_coeff`` and ``use_kl_loss`` / ``kl_loss_coef`` /
``kl_loss_type`` in ``dp_actor.update_policy``: ``pg_loss - entropy_coeff * agg_loss(entropy)
+ kl_loss_coef * agg_loss(kl_penalty(...))``, both with the actor's ``loss_agg_mode``), and the
``ENT_COEF`` of PPO implementations (purejaxrl). rStar2-Agent trains with neither (both 0, the
default).

A loss that wants other terms, or these terms weighed differently, declares ``entropy`` and/or
``ref_logp`` as parameters and computes them itself (`rstar2_jax.algorithms.algorithm`,
docs/algorithms.md).
"""
from __future__ import annotations

import inspect
from typing import Literal, get_args

import jax
import jax.numpy as jnp

from rstar2_jax.algorithms.algorithm import LOSS_INPUTS, LossFn, loss_inputs
from rstar2_jax.algorithms.loss import aggregate, constant, k3

KLPenalty = Literal["k1", "k2", "k3", "low_var_kl", "abs", "mse"]
KL_PENALTIES = get_args(KLPenalty)


def kl_penalty(logp: jnp.ndarray, ref_logp: jnp.ndarray, kind: KLPenalty = "low_var_kl") -> jnp.ndarray:
    """Per-token estimate of KL(policy || reference) from tokens sampled from the policy, with
    d = logp - ref_logp (nats, any shape; no gradient flows into ``ref_logp``):

        k1:                 d                       unbiased, can be negative
        k2, "mse":          d^2 / 2                 biased, >= 0; its gradient d * grad logp
                                                    is an unbiased estimate of KL's gradient
        k3, "low_var_kl":   e^-d + d - 1            unbiased, >= 0, lower variance than k1
                                                    (-d clamped to [-20, 20], the estimate to
                                                    at most 10, as verl does)
        abs:                |d|

    J. Schulman, "Approximating KL divergence" (2020); verl's ``kl_penalty_forward`` in
    ``verl/trainer/ppo/core_algos.py`` (the same names and clamps).
    """
    if kind not in _ESTIMATES:
        raise ValueError(f"kl_penalty must be one of {', '.join(KL_PENALTIES)}, got {kind!r}")
    return _ESTIMATES[kind](logp - jax.lax.stop_gradient(ref_logp))


def _k2(d):
    return 0.5 * jnp.square(d)


def _k3(d):
    return jnp.minimum(k3(jnp.clip(-d, -20.0, 20.0)), 10.0)


_ESTIMATES = {"k1": lambda d: d, "k2": _k2, "mse": _k2, "k3": _k3, "low_var_kl": _k3, "abs": jnp.abs}


def loss_aggregation(loss: LossFn) -> tuple[str, int | None] | None:
    """``(loss_agg_mode, norm_length)`` that ``loss`` declares: the values of its parameters of
    those names (given by a ``functools.partial``, or their defaults); None when it has no
    ``loss_agg_mode`` parameter."""
    try:
        parameters = inspect.signature(loss).parameters
    except (TypeError, ValueError):
        return None
    mode = parameters.get("loss_agg_mode")
    if mode is None or mode.default is inspect.Parameter.empty:
        return None
    norm = parameters.get("norm_length")
    return mode.default, None if norm is None or norm.default is inspect.Parameter.empty else norm.default


def regularized(loss: LossFn, *, entropy_coef: float = 0.0, kl_coef: float = 0.0,
                kl_penalty: KLPenalty = "low_var_kl") -> LossFn:
    """``loss`` with the entropy bonus and the KL penalty added (module docstring); ``loss``
    itself when both coefficients are 0.

    The terms use the aggregation ``loss`` declares (`loss_aggregation`: all the losses of this
    package do); a loss without a ``loss_agg_mode`` parameter raises ValueError. The result
    takes ``entropy`` when ``entropy_coef`` is set and ``ref_logp`` when ``kl_coef`` is (plus
    whatever ``loss`` takes itself), and adds the metrics ``entropy_loss`` / ``kl_loss``: the
    aggregated entropy / KL estimate, summed as the loss sums, so that the logged loss is
    ``policy loss - entropy_coef * entropy_loss + kl_coef * kl_loss``.
    """
    if entropy_coef < 0 or kl_coef < 0:
        raise ValueError(f"entropy_coef and kl_coef must be >= 0, got {entropy_coef} and {kl_coef}")
    if kl_penalty not in _ESTIMATES:
        raise ValueError(f"kl_penalty must be one of {', '.join(KL_PENALTIES)}, got {kl_penalty!r}")
    estimate = _ESTIMATES[kl_penalty]
    if entropy_coef == 0 and kl_coef == 0:
        return loss
    aggregation = loss_aggregation(loss)
    if aggregation is None:
        raise ValueError("the entropy bonus and the KL penalty are aggregated as the algorithm's "
                         "loss aggregates, and its loss declares no loss_agg_mode parameter: give "
                         "it one, or add the terms in the loss itself (docs/algorithms.md)")
    mode, norm_length = aggregation
    own = loss_inputs(loss)
    wants = {"entropy": entropy_coef != 0, "ref_logp": kl_coef != 0}

    def with_terms(logp, old_logp, advantages, mask, **inputs):
        loss_sum, count, metrics = loss(logp, old_logp, advantages, mask,
                                        **{name: inputs[name] for name in own})
        mask = jnp.asarray(mask).astype(bool)
        metrics = dict(metrics)
        if entropy_coef:
            term, _, _ = aggregate(inputs["entropy"], mask, mode, norm_length)
            loss_sum = loss_sum - entropy_coef * term
            metrics |= constant({"entropy_loss": term})
        if kl_coef:
            # Garbage at masked positions is replaced before exp (0 * inf is NaN in the gradient).
            d = jnp.where(mask, logp - jax.lax.stop_gradient(inputs["ref_logp"]), 0.0)
            term, _, _ = aggregate(estimate(d), mask, mode, norm_length)
            loss_sum = loss_sum + kl_coef * term
            metrics |= constant({"kl_loss": term})
        return loss_sum, count, metrics

    # Declared by name, like any loss's inputs: the trainer computes what the signature asks for.
    with_terms.__signature__ = inspect.Signature(
        [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD)
         for name in ("logp", "old_logp", "advantages", "mask")]
        + [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY)
           for name in LOSS_INPUTS if name in own or wants[name]])
    return with_terms
