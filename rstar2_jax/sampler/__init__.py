"""Sampling: plain batched generation and agentic multi-turn rollouts with tool calls."""
from rstar2_jax.sampler.engine import Engine
from rstar2_jax.sampler.generate import Generation, generate
from rstar2_jax.sampler.rollout import (
    AgentSampler,
    RolloutStats,
    RolloutStopped,
    ToolCallRecord,
    Trajectory,
)
from rstar2_jax.sampler.sampling import SamplingParams, sample_tokens
from rstar2_jax.sampler.settings import RolloutLimits, RolloutSettings

__all__ = [
    "AgentSampler", "Engine", "Generation", "RolloutLimits", "RolloutSettings", "RolloutStats",
    "RolloutStopped", "SamplingParams", "ToolCallRecord", "Trajectory", "generate",
    "sample_tokens",
]
