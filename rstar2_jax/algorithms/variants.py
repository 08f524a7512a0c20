"""Well-known algorithms as `Algorithm` values, and the names a config picks them by.

Each is a few lines on the seam; the formulas are in the docstrings of the functions it names.

    rl.algorithm=grpo_roc                     a name of `ALGORITHMS` (the default)
    rl.algorithm=my_package.my_module:MINE    an Algorithm defined in your own code

`ALGORITHMS` is the list of names; docs/algorithms.md tabulates each one's selection, advantage
and loss (a test keeps that table equal to this registry).

Any of them trains with a rollout correction (``rl.rollout_correction``,
`rstar2_jax.algorithms.correction`), an entropy bonus and a KL penalty to a reference policy
(``rl.entropy_coef``, ``rl.kl_coef``: `rstar2_jax.algorithms.regularizers`): they are settings
of the run, not algorithms.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import sys

from rstar2_jax.algorithms.advantages import (
    dr_grpo_advantages,
    gpg_advantages,
    grpo_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from rstar2_jax.algorithms.algorithm import Algorithm
from rstar2_jax.algorithms.loss import policy_loss
from rstar2_jax.algorithms.roc import roc_selection
from rstar2_jax.algorithms.selection import keep_all, keep_every_group, overlong_filtered
from rstar2_jax.algorithms.sequence_losses import gmpo_loss, gspo_loss
from rstar2_jax.algorithms.token_losses import cispo_loss, gpg_loss, sapo_loss

# GRPO-RoC (rStar2-Agent §2.2, Eq. 6-7): RoC keeps G of 2G rollouts, A_i = (r_i - mean) / std over
# the kept G, loss -1/sum|o_i| * sum_i sum_t min(rho A_i, clip(rho, 1 - 0.2, 1 + 0.28) A_i).
GRPO_ROC = Algorithm(select=functools.partial(roc_selection, mode="paper"),
                     advantages=grpo_advantages, loss=policy_loss)

# The same with the released code's RoC rule and penalty counting (`roc.RULES`).
GRPO_ROC_RELEASED = dataclasses.replace(GRPO_ROC, select=functools.partial(roc_selection, mode="released"))

# Plain GRPO as rStar2-Agent's baseline ("GRPO with tool", §5.3): every sampled rollout is kept,
# nothing else changes. Not DeepSeekMath's original objective (per-sequence mean, k3 KL term):
# that is `policy_loss(..., loss_agg_mode="seq-mean-token-mean")` trained with
# rl.reference=true rl.kl_coef=0.04 rl.kl_penalty=k3 (`regularizers`).
GRPO = dataclasses.replace(GRPO_ROC, select=keep_all)

# Dr. GRPO (Liu et al. 2025, Eq. 3): A_i = r_i - mean(r), and the loss
# -1/G * sum_i sum_t min(rho A_i, clip(rho) A_i), a token sum per sequence averaged over
# sequences: no 1/|o_i|, so no length bias. (The authors' code also divides by a constant, the
# generation budget; under Adam that only rescales the gradient clipping threshold.)
DR_GRPO = Algorithm(select=keep_all, advantages=dr_grpo_advantages,
                    loss=functools.partial(policy_loss, loss_agg_mode="seq-mean-token-sum"))

# GSPO (Zheng et al. 2025, Eq. 5-7): GRPO's advantage with a sequence-level, length-normalised
# importance ratio s_i = (pi / pi_old)(y_i)^(1/|y_i|), clipped per sequence at 1 -/+ 3e-4 / 4e-4.
GSPO = Algorithm(select=keep_all, advantages=grpo_advantages, loss=gspo_loss)

# DAPO (Yu et al. 2025, Eq. 8): clipped token-level loss with Clip-Higher 0.2 / 0.28 and a token
# mean over the batch, GRPO's advantage; groups of equal rewards dropped (dynamic sampling's
# filter, without re-sampling) and the loss of truncated rollouts masked (overlong filtering).
DAPO = Algorithm(select=overlong_filtered(keep_all), advantages=grpo_advantages, loss=policy_loss)

# Dr. GRPO as its authors' code runs it: the token sum of each sequence divided by a constant
# length (here the padded row length, fixed for a run) before the mean over sequences.
DR_GRPO_NORM = dataclasses.replace(
    DR_GRPO, loss=functools.partial(policy_loss, loss_agg_mode="seq-mean-token-sum-norm"))

# RLOO (Ahmadian et al. 2024): each reward minus the mean of the other rollouts' rewards, and
# REINFORCE on the sequence's log-probability, the token sum per sequence averaged over
# sequences. On policy (one update per batch) the clipped surrogate is exactly that REINFORCE;
# it clips only on later mini-batches. verl pairs its RLOO estimator with its actor's loss
# aggregation, token-mean by default.
RLOO = Algorithm(select=keep_all, advantages=rloo_advantages,
                 loss=functools.partial(policy_loss, loss_agg_mode="seq-mean-token-sum"))

# REINFORCE++-baseline (Hu et al. 2025): the group mean as baseline, then the step's advantages
# whitened over all loss tokens; PPO's clipped surrogate, token mean. Every group is kept: the
# groups of equal rewards enter the whitening statistics and get a nonzero advantage, as in
# verl and OpenRLHF. The paper's KL term to a reference model is off unless the run sets
# rl.reference=true and rl.kl_coef (`regularizers`).
REINFORCE_PP_BASELINE = Algorithm(select=keep_every_group,
                                  advantages=reinforce_pp_baseline_advantages, loss=policy_loss)

# CISPO (MiniMax-M1, 2025): GRPO's advantage, the clipped importance weight held constant in a
# REINFORCE loss, token mean.
CISPO = Algorithm(select=keep_all, advantages=grpo_advantages, loss=cispo_loss)

# GPG (Chu et al. 2025): the plain policy gradient with alpha-scaled group-centred advantages;
# every group is kept, since alpha = B / (B - M) counts the groups without signal.
GPG = Algorithm(select=keep_every_group, advantages=gpg_advantages, loss=gpg_loss)

# GMPO (Zhao et al. 2025): GRPO's advantage, the geometric mean of the token ratios clipped in
# log space at +-0.4, mean over sequences (verl's loss_mode "geo_mean").
GMPO = Algorithm(select=keep_all, advantages=grpo_advantages, loss=gmpo_loss)

# SAPO (Gao et al. 2025): GRPO's advantage, the hard clip replaced by a sigmoid gate of the
# ratio, mean over sequences of each sequence's token mean.
SAPO = Algorithm(select=keep_all, advantages=grpo_advantages, loss=sapo_loss)

ALGORITHMS: dict[str, Algorithm] = {
    "grpo": GRPO,
    "grpo_roc": GRPO_ROC,
    "grpo_roc_released": GRPO_ROC_RELEASED,
    "dr_grpo": DR_GRPO,
    "gspo": GSPO,
    "dapo": DAPO,
    "dr_grpo_norm": DR_GRPO_NORM,
    "rloo": RLOO,
    "reinforce_plus_plus_baseline": REINFORCE_PP_BASELINE,
    "cispo": CISPO,
    "gpg": GPG,
    "gmpo": GMPO,
    "sapo": SAPO,
}


def resolve_algorithm(spec: str) -> Algorithm:
    """The `Algorithm` that ``spec`` names: a key of `ALGORITHMS`, or ``package.module:object``
    for one defined in user code (the module must be importable: installed or on ``sys.path``).

    Raises ValueError saying why it cannot be resolved.
    """
    if ":" not in spec:
        if spec not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {spec!r}: use one of {', '.join(ALGORITHMS)} "
                             f"or an import path 'package.module:object'")
        return ALGORITHMS[spec]
    module_name, _, attribute = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import module {module_name!r} of algorithm {spec!r}: {e}") from None
    algorithm = module
    for part in attribute.split("."):
        if not hasattr(algorithm, part):
            raise ValueError(f"module {module_name!r} has no {attribute!r} (algorithm {spec!r})")
        algorithm = getattr(algorithm, part)
    if not isinstance(algorithm, Algorithm):
        raise ValueError(f"{spec!r} is a {type(algorithm).__name__}, not an "
                         f"rstar2_jax.algorithms.Algorithm")
    return algorithm


def algorithm_spec(algorithm: Algorithm) -> str | None:
    """The name ``rl.algorithm`` would give ``algorithm`` (`resolve_algorithm` of it returns
    this very object): its key in `ALGORITHMS`, else ``module:name`` of a module-level name
    bound to it in an imported module (a notebook's own included, as ``__main__:name``);
    None when nothing names it (built inside a function)."""
    for name, known in ALGORITHMS.items():
        if known is algorithm:
            return name
    for module_name, module in list(sys.modules.items()):
        for attribute, value in list(getattr(module, "__dict__", {}).items()):
            if value is algorithm and not attribute.startswith("_"):
                return f"{module_name}:{attribute}"
    return None
