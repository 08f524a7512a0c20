"""AdamW with linear warmup, a constant or cosine schedule and global-norm gradient clipping."""
from __future__ import annotations

import math

import jax.numpy as jnp
import optax

from rstar2_jax.train.configs import OptimizerConfig


def lr_schedule(config: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """Learning rate as a function of the number of updates already applied (0-based).

    Warmup is linear and reaches ``config.lr`` at update ``warmup_steps - 1``: the first update
    already moves the weights (at ``lr / warmup_steps``) instead of being a wasted step at lr 0.
    The cosine decays from ``lr`` to ``final_lr_ratio * lr`` over ``decay_steps`` updates after
    warmup (default: the rest of the job, ``total_steps - warmup_steps``) and stays there.
    """
    warmup = max(config.warmup_steps, 1)
    decay = config.decay_steps or max(total_steps - config.warmup_steps, 1)

    def schedule(count):
        count = jnp.asarray(count, jnp.float32)
        lr = config.lr * jnp.minimum(1.0, (count + 1.0) / warmup)
        if config.schedule == "constant":
            return lr
        progress = jnp.clip((count - config.warmup_steps) / decay, 0.0, 1.0)
        cosine = 0.5 * (1.0 + jnp.cos(math.pi * progress))
        return lr * (config.final_lr_ratio + (1.0 - config.final_lr_ratio) * cosine)

    return schedule


def make_optimizer(config: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW (decoupled weight decay on every parameter, as torch and
    verl do) with :func:`lr_schedule`. :func:`current_lr` reads the rate back from the state."""

    def clipped_adamw(learning_rate):
        return optax.chain(
            optax.clip_by_global_norm(config.grad_clip),
            optax.adamw(learning_rate, b1=config.b1, b2=config.b2, eps=config.eps,
                        weight_decay=config.weight_decay),
        )

    # inject_hyperparams keeps the rate of the latest update in the state, so the logged lr is
    # exactly the one applied, and it follows the optimizer's own count through resets.
    return optax.inject_hyperparams(clipped_adamw)(learning_rate=lr_schedule(config, total_steps))


def current_lr(opt_state) -> jnp.ndarray:
    """The learning rate of the most recent update (of the first one, before any update)."""
    return opt_state.hyperparams["learning_rate"]
