"""Command-line entry point: ``python -m rstar2_jax <command> ...``."""
import sys

from rstar2_jax.cli import main

if __name__ == "__main__":
    sys.exit(main())
