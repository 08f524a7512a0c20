"""Subcommands of ``python -m rstar2_jax``.

Training jobs take a YAML config and ``key=value`` overrides, checked against the job's frozen
dataclass (``rstar2_jax.train.configs``); a bad key or value stops with a message naming it::

    python -m rstar2_jax sft --config experiments/paper/sft.yaml run_dir=runs/sft
    python -m rstar2_jax export runs/sft/checkpoints out/hf [--step 300]
    python -m rstar2_jax scale-plan model=qwen3-14b devices=64 tp=1

A new job is one function here plus one ``add_parser`` line in ``main``.
"""
from __future__ import annotations

import argparse
import logging
import sys

from rstar2_jax.config import ConfigError, load_config


def _demo(args: argparse.Namespace) -> int:
    # Placeholder until the toy main job lands: proves the install works end to end.
    import jax

    print(f"rstar2-jax installed; jax {jax.__version__} on {jax.devices()}")
    return 0


def _sft(args: argparse.Namespace) -> int:
    from rstar2_jax.train.configs import SFTConfig
    from rstar2_jax.train.sft import run_sft

    state = run_sft(load_config(SFTConfig, args.config, args.overrides))
    print(f"SFT finished at step {int(state.step)}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from rstar2_jax.train.checkpoint import export_hf

    step = export_hf(args.checkpoints, args.output, step=args.step)
    print(f"exported step {step} of {args.checkpoints} to {args.output}")
    return 0


def _scale_plan(args: argparse.Namespace) -> int:
    from rstar2_jax.train.scale_plan import ScalePlanConfig, format_plan, run_in_subprocess

    config = load_config(ScalePlanConfig, args.config, args.overrides)
    print(format_plan(run_in_subprocess(config)))
    return 0


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML file with the job's config")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides, applied after the file (e.g. optimizer.lr=1e-6)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rstar2_jax")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="the main job: a CPU toy that trains in minutes")
    demo.set_defaults(func=_demo)

    sft = sub.add_parser("sft", help="supervised fine-tuning on chat-formatted JSONL")
    _add_config_args(sft)
    sft.set_defaults(func=_sft)

    export = sub.add_parser("export", help="write a checkpoint as a Hugging Face model")
    export.add_argument("checkpoints", help="a run's checkpoints directory (<run_dir>/checkpoints)")
    export.add_argument("output", help="directory for config.json + model.safetensors")
    export.add_argument("--step", type=int, help="checkpoint step (default: newest readable)")
    export.set_defaults(func=_export)

    plan = sub.add_parser("scale-plan", help="per-device memory of the RL step at scale, "
                                             "compiled on fake devices without weights")
    _add_config_args(plan)
    plan.set_defaults(func=_scale_plan)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
