"""Subcommands of ``python -m rstar2_jax``."""
from __future__ import annotations

import argparse


def _demo(args: argparse.Namespace) -> int:
    # Placeholder until the toy main job lands: proves the install works end to end.
    import jax

    print(f"rstar2-jax installed; jax {jax.__version__} on {jax.devices()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rstar2_jax")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="the main job: a CPU toy that trains in minutes")
    demo.set_defaults(func=_demo)
    args = parser.parse_args(argv)
    return args.func(args)
