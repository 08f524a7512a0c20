"""RL algorithms as pure functions of arrays (no model, no I/O), and the seam that passes them to
the trainer: an `Algorithm` is three functions, select -> advantages -> loss
(`rstar2_jax.algorithms.algorithm` has their contracts).

One RL step of GRPO-RoC, per question with 2G rollouts (docs/algorithms.md):

    selection  = roc_selection(key, rollouts, G)        # drop all-equal groups, RoC 2G -> G
    advantages = grpo_advantages(rollouts.take(selection.index))          # [groups, G]
    loss_sum, count, metric_sums = policy_loss(logp, old_logp, advantages, mask)

Named variants (GRPO, GRPO-RoC paper / released, Dr. GRPO, GSPO, DAPO) are in `variants`; a
config picks one with ``rl.algorithm`` (`resolve_algorithm`).
"""
from rstar2_jax.algorithms.advantages import dr_grpo_advantages, group_advantages, grpo_advantages
from rstar2_jax.algorithms.algorithm import Algorithm, Rollouts, Selection, group_index
from rstar2_jax.algorithms.loss import gspo_loss, policy_loss
from rstar2_jax.algorithms.roc import (
    RULES,
    paper_penalty_terms,
    penalty_terms,
    released_penalty_terms,
    roc_penalty,
    roc_select,
    roc_select_batch,
    roc_selection,
)
from rstar2_jax.algorithms.selection import keep_all, nonuniform_group_mask, overlong_filtered
from rstar2_jax.algorithms.variants import (
    ALGORITHMS,
    DAPO,
    DR_GRPO,
    GRPO,
    GRPO_ROC,
    GRPO_ROC_RELEASED,
    GSPO,
    resolve_algorithm,
)

__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "DAPO",
    "DR_GRPO",
    "GRPO",
    "GRPO_ROC",
    "GRPO_ROC_RELEASED",
    "GSPO",
    "RULES",
    "Rollouts",
    "Selection",
    "dr_grpo_advantages",
    "group_advantages",
    "group_index",
    "grpo_advantages",
    "gspo_loss",
    "keep_all",
    "nonuniform_group_mask",
    "overlong_filtered",
    "paper_penalty_terms",
    "penalty_terms",
    "policy_loss",
    "released_penalty_terms",
    "resolve_algorithm",
    "roc_penalty",
    "roc_select",
    "roc_select_batch",
    "roc_selection",
]
