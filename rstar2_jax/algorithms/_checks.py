"""Input checks that work both eagerly and under `jax.jit` / `jax.vmap`, and the array namespace
of the host-side functions.

Shape checks are static, so they always run. Value checks (a reward that is not 0 or 1, a negative
count) need concrete numbers: they run when the caller passes concrete arrays and are skipped
inside a trace, where there is no Python value to test. Callers that jit or vmap these functions
should validate once on the host first (the batched helpers here do that before vmapping).
"""
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np


def array_namespace(*xs):
    """``jax.numpy`` when any of ``xs`` is a jax array (a tracer under `jax.jit` / `jax.vmap`
    included), else ``numpy``. The selections and estimators run on the host, once a step, on
    numpy arrays of a shape that changes with what a step keeps: in numpy they compile nothing,
    where each `jax.numpy` operation would compile a program per new shape. Given jax arrays
    they stay jit-able."""
    return jnp if any(isinstance(x, jax.Array) for x in xs) else np


def as_float(x, xp):
    """``x`` in float32, or in its own float type when wider (``xp``: its namespace)."""
    if xp.issubdtype(x.dtype, xp.floating):
        return x.astype(xp.promote_types(x.dtype, xp.float32))
    return x.astype(xp.float32)


def check_values(x, is_valid: Callable[[np.ndarray], np.ndarray], message: str) -> None:
    """Raises ValueError(message) if `is_valid(x)` is not all true; skipped for traced `x`."""
    if isinstance(x, jax.core.Tracer):
        return
    if not np.all(is_valid(np.asarray(x))):
        raise ValueError(message)
