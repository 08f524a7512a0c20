"""Input checks that work both eagerly and under `jax.jit` / `jax.vmap`.

Shape checks are static, so they always run. Value checks (a reward that is not 0 or 1, a negative
count) need concrete numbers: they run when the caller passes concrete arrays and are skipped
inside a trace, where there is no Python value to test. Callers that jit or vmap these functions
should validate once on the host first (the batched helpers here do that before vmapping).
"""
from collections.abc import Callable

import jax
import numpy as np


def check_values(x, is_valid: Callable[[np.ndarray], np.ndarray], message: str) -> None:
    """Raises ValueError(message) if `is_valid(x)` is not all true; skipped for traced `x`."""
    if isinstance(x, jax.core.Tracer):
        return
    if not np.all(is_valid(np.asarray(x))):
        raise ValueError(message)
