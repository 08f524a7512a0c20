"""RL algorithms as pure functions of arrays (no model, no I/O), and the seam that passes them to
the trainer: an `Algorithm` is three functions, select -> advantages -> loss
(`rstar2_jax.algorithms.algorithm` has their contracts).

One RL step of GRPO-RoC, per question with 2G rollouts (docs/algorithms.md):

    selection  = roc_selection(key, rollouts, G)        # drop all-equal groups, RoC 2G -> G
    advantages = grpo_advantages(rollouts.take(selection.index))          # [groups, G]
    loss_sum, count, metric_sums = policy_loss(logp, old_logp, advantages, mask)

Named variants (GRPO, GRPO-RoC paper / released, Dr. GRPO, GSPO, DAPO, RLOO,
REINFORCE++-baseline, CISPO, GPG, GMPO, SAPO) are in `variants`; a config picks one with
``rl.algorithm`` (`resolve_algorithm`). The rollout correction for the sampler/trainer gap, an
option of any of them, is in `correction` (``rl.rollout_correction``); the entropy bonus and
the KL penalty to a reference policy, options of any of them too, in `regularizers`
(``rl.entropy_coef``, ``rl.kl_coef``).
"""
from rstar2_jax.algorithms.advantages import (
    dr_grpo_advantages,
    gpg_advantages,
    group_advantages,
    grpo_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from rstar2_jax.algorithms.algorithm import (
    LOSS_INPUTS,
    Algorithm,
    Rollouts,
    Selection,
    group_index,
    loss_inputs,
)
from rstar2_jax.algorithms.correction import (
    RolloutCorrection,
    apply_correction,
    areal_weights,
    icepop_weights,
    importance_weights,
    log_ratios,
    m2po_weights,
    mismatch_metrics,
    ratio_in_range,
)
from rstar2_jax.algorithms.loss import aggregate, policy_loss
from rstar2_jax.algorithms.regularizers import (
    KL_PENALTIES,
    kl_penalty,
    loss_aggregation,
    regularized,
)
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
from rstar2_jax.algorithms.selection import (
    keep_all,
    keep_every_group,
    nonuniform_group_mask,
    overlong_filtered,
)
from rstar2_jax.algorithms.sequence_losses import gmpo_loss, gspo_loss
from rstar2_jax.algorithms.token_losses import cispo_loss, gpg_loss, sapo_loss
from rstar2_jax.algorithms.variants import (
    ALGORITHMS,
    CISPO,
    DAPO,
    DR_GRPO,
    DR_GRPO_NORM,
    GMPO,
    GPG,
    GRPO,
    GRPO_ROC,
    GRPO_ROC_RELEASED,
    GSPO,
    REINFORCE_PP_BASELINE,
    RLOO,
    SAPO,
    algorithm_spec,
    resolve_algorithm,
)

__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "CISPO",
    "DAPO",
    "DR_GRPO",
    "DR_GRPO_NORM",
    "GMPO",
    "GPG",
    "GRPO",
    "GRPO_ROC",
    "GRPO_ROC_RELEASED",
    "GSPO",
    "KL_PENALTIES",
    "LOSS_INPUTS",
    "REINFORCE_PP_BASELINE",
    "RLOO",
    "RULES",
    "RolloutCorrection",
    "Rollouts",
    "SAPO",
    "Selection",
    "aggregate",
    "apply_correction",
    "areal_weights",
    "cispo_loss",
    "dr_grpo_advantages",
    "gmpo_loss",
    "gpg_advantages",
    "gpg_loss",
    "group_advantages",
    "group_index",
    "grpo_advantages",
    "gspo_loss",
    "icepop_weights",
    "importance_weights",
    "keep_all",
    "keep_every_group",
    "kl_penalty",
    "log_ratios",
    "loss_aggregation",
    "loss_inputs",
    "m2po_weights",
    "mismatch_metrics",
    "nonuniform_group_mask",
    "overlong_filtered",
    "paper_penalty_terms",
    "penalty_terms",
    "policy_loss",
    "ratio_in_range",
    "regularized",
    "reinforce_pp_baseline_advantages",
    "released_penalty_terms",
    "algorithm_spec",
    "resolve_algorithm",
    "rloo_advantages",
    "roc_penalty",
    "roc_select",
    "roc_select_batch",
    "roc_selection",
    "sapo_loss",
]
