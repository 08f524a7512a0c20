"""Well-known algorithms as `Algorithm` values, and the names a config picks them by.

Each is a few lines on the seam; the formulas are in the docstrings of the functions it names.

    rl.algorithm=grpo_roc                     a name below (the default)
    rl.algorithm=my_package.my_module:MINE    an Algorithm defined in your own code

| name                | select                          | advantages           | loss                            |
|---------------------|---------------------------------|----------------------|---------------------------------|
| `grpo`              | `keep_all`                      | `grpo_advantages`    | `policy_loss` (token mean)      |
| `grpo_roc`          | `roc_selection`, paper rule     | `grpo_advantages`    | `policy_loss` (token mean)      |
| `grpo_roc_released` | `roc_selection`, released rule  | `grpo_advantages`    | `policy_loss` (token mean)      |
| `dr_grpo`           | `keep_all`                      | `dr_grpo_advantages` | `policy_loss` (seq-mean-token-sum) |
| `gspo`              | `keep_all`                      | `grpo_advantages`    | `gspo_loss`                     |
| `dapo`              | `overlong_filtered(keep_all)`   | `grpo_advantages`    | `policy_loss` (token mean)      |
"""
from __future__ import annotations

import dataclasses
import functools
import importlib

from rstar2_jax.algorithms.advantages import dr_grpo_advantages, grpo_advantages
from rstar2_jax.algorithms.algorithm import Algorithm
from rstar2_jax.algorithms.loss import gspo_loss, policy_loss
from rstar2_jax.algorithms.roc import roc_selection
from rstar2_jax.algorithms.selection import keep_all, overlong_filtered

# GRPO-RoC (rStar2-Agent §2.2, Eq. 6-7): RoC keeps G of 2G rollouts, A_i = (r_i - mean) / std over
# the kept G, loss -1/sum|o_i| * sum_i sum_t min(rho A_i, clip(rho, 1 - 0.2, 1 + 0.28) A_i).
GRPO_ROC = Algorithm(select=functools.partial(roc_selection, mode="paper"),
                     advantages=grpo_advantages, loss=policy_loss)

# The same with the released code's RoC rule and penalty counting (`roc.RULES`).
GRPO_ROC_RELEASED = dataclasses.replace(GRPO_ROC, select=functools.partial(roc_selection, mode="released"))

# Plain GRPO as rStar2-Agent's baseline ("GRPO with tool", §5.3): every sampled rollout is kept,
# nothing else changes. Not DeepSeekMath's original objective (per-sequence mean, KL term):
# that is `policy_loss(..., loss_agg_mode="seq-mean-token-mean")` with a reference policy.
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

ALGORITHMS: dict[str, Algorithm] = {
    "grpo": GRPO,
    "grpo_roc": GRPO_ROC,
    "grpo_roc_released": GRPO_ROC_RELEASED,
    "dr_grpo": DR_GRPO,
    "gspo": GSPO,
    "dapo": DAPO,
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
