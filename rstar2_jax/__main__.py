"""Command-line entry point: ``python -m rstar2_jax <command> ...``.

Every job run this way uses JAX's persistent compilation cache (``rstar2_jax.compile_cache``).
"""
import sys

from rstar2_jax.cli import main
from rstar2_jax.compile_cache import enable_persistent_cache

if __name__ == "__main__":
    enable_persistent_cache()
    sys.exit(main())
