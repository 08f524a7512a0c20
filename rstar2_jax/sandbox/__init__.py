"""Python tool sandbox: a pool of warm template processes running each call in a contained child.

Public API: ``SandboxPool`` (the local ``Executor``), ``Session`` (a trajectory's calls sharing
state), ``ExecResult``, ``render_result`` (the text the model sees), ``SandboxConfig`` (limits).
See docs/sandbox.md for the containment levels and the multi-host design.
"""
from rstar2_jax.sandbox.config import SandboxConfig
from rstar2_jax.sandbox.executor import Call, Executor
from rstar2_jax.sandbox.pool import SandboxPool
from rstar2_jax.sandbox.result import STATUSES, ExecResult, render_result
from rstar2_jax.sandbox.session import Session

__all__ = ["Call", "ExecResult", "Executor", "STATUSES", "SandboxConfig", "SandboxPool", "Session",
           "render_result"]
