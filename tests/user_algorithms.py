"""Two algorithms as a user writes them, outside the package (docs/algorithms.md shows the same):
GRPO with an entropy bonus in its own loss, and GRPO with a k3 KL penalty to the reference
policy (a run with ``rl.reference=true``). Each loss declares the extra input it needs by name.
"""
import dataclasses

import jax

from rstar2_jax.algorithms import GRPO, aggregate, kl_penalty, policy_loss

ENTROPY_COEF = 0.01
KL_COEF = 0.1


def entropy_bonus_loss(logp, old_logp, advantages, mask, *, entropy):
    """GRPO's clipped surrogate minus ENTROPY_COEF x the token mean of the policy's entropy."""
    loss_sum, count, metrics = policy_loss(logp, old_logp, advantages, mask)
    entropy_sum, _, _ = aggregate(entropy, mask, "token-mean")  # the sum the count divides
    return (loss_sum - ENTROPY_COEF * entropy_sum, count,
            metrics | {"mine/entropy": jax.lax.stop_gradient(entropy_sum)})


def kl_penalty_loss(logp, old_logp, advantages, mask, *, ref_logp):
    """GRPO's clipped surrogate plus KL_COEF x the token mean of k3 KL(policy || reference)."""
    loss_sum, count, metrics = policy_loss(logp, old_logp, advantages, mask)
    kl_sum, _, _ = aggregate(kl_penalty(logp, ref_logp, "k3"), mask, "token-mean")
    return loss_sum + KL_COEF * kl_sum, count, metrics | {"mine/kl": jax.lax.stop_gradient(kl_sum)}


ENTROPY_GRPO = dataclasses.replace(GRPO, loss=entropy_bonus_loss)
KL_GRPO = dataclasses.replace(GRPO, loss=kl_penalty_loss)
