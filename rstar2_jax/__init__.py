"""rstar2-jax: agentic reinforcement learning (GRPO-RoC) for math reasoning with a Python tool, in JAX."""

__version__ = "0.1.0"
