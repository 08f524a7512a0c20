"""GRPO-RoC as pure functions of arrays (no model, no I/O), jit- and vmap-friendly.

Order of use within one RL step, per question with 2G rollouts (DESIGN.md §3):

    keep_question = nonuniform_group_mask(rewards_2g)             # drop all-equal groups
    penalties     = roc_penalty(calls, errors, answer_blocks, turns)
    kept          = roc_select_batch(key, rewards_2g, penalties, G)  # [questions, G] indices
    advantages    = group_advantages(rewards of the kept rollouts)   # [questions, G]
    loss_sum, denominator, metrics = policy_loss(logp, old_logp, advantages, mask)
"""
from rstar2_jax.algorithms.advantages import group_advantages, nonuniform_group_mask
from rstar2_jax.algorithms.loss import policy_loss
from rstar2_jax.algorithms.roc import penalty_terms, roc_penalty, roc_select, roc_select_batch

__all__ = [
    "group_advantages",
    "nonuniform_group_mask",
    "penalty_terms",
    "policy_loss",
    "roc_penalty",
    "roc_select",
    "roc_select_batch",
]
