"""Subcommands of ``python -m rstar2_jax``.

Training jobs take a YAML config and ``key=value`` overrides, checked against the job's frozen
dataclass (``rstar2_jax.train.configs``); a bad key or value stops with a message naming it::

    python -m rstar2_jax sft --config experiments/paper/sft.yaml run_dir=runs/sft
    python -m rstar2_jax rl --config experiments/paper/stage1.yaml
    python -m rstar2_jax eval --config experiments/paper/eval_aime.yaml model.path=out/hf
    python -m rstar2_jax hard-subset --config experiments/paper/stage3.yaml
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
    from rstar2_jax.toy.demo import DemoConfig, run_demo

    run_demo(load_config(DemoConfig, args.config, args.overrides))
    return 0


def _sft(args: argparse.Namespace) -> int:
    from rstar2_jax.train.configs import SFTConfig
    from rstar2_jax.train.sft import run_sft

    state = run_sft(load_config(SFTConfig, args.config, args.overrides))
    print(f"SFT finished at step {int(state.step)}")
    return 0


def _rl(args: argparse.Namespace) -> int:
    from rstar2_jax.train.configs import RLJobConfig
    from rstar2_jax.train.rl import run_rl

    state = run_rl(load_config(RLJobConfig, args.config, args.overrides))
    print(f"RL finished at step {int(state.step)}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from rstar2_jax.evaluate import run_eval, write_samples
    from rstar2_jax.train.configs import EvalConfig

    config = load_config(EvalConfig, args.config, args.overrides)
    report, records = run_eval(config)
    write_samples(config.output, records)
    print(report.summary())
    print(f"per-sample trajectories: {config.output}")
    return 0


def _hard_subset(args: argparse.Namespace) -> int:
    from rstar2_jax.evaluate import run_hard_subset
    from rstar2_jax.train.configs import RLJobConfig

    config = load_config(RLJobConfig, args.config, args.overrides)
    kept, total = run_hard_subset(config)
    print(f"kept {kept} of {total} problems (not solved {config.hard_subset.samples}/"
          f"{config.hard_subset.samples}) in {config.hard_subset.output}")
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
    _add_config_args(demo)
    demo.set_defaults(func=_demo)

    sft = sub.add_parser("sft", help="supervised fine-tuning on chat-formatted JSONL")
    _add_config_args(sft)
    sft.set_defaults(func=_sft)

    rl = sub.add_parser("rl", help="one GRPO-RoC stage (rollouts, RoC, updates)")
    _add_config_args(rl)
    rl.set_defaults(func=_rl)

    evaluation = sub.add_parser("eval", help="average pass@1 / pass@k of a policy on a problem set")
    _add_config_args(evaluation)
    evaluation.set_defaults(func=_eval)

    hard = sub.add_parser("hard-subset", help="the problems a stage's starting policy does not "
                                              "solve k/k (its hard_subset section)")
    _add_config_args(hard)
    hard.set_defaults(func=_hard_subset)

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
    import rstar2_jax.toy.format  # noqa: F401  registers model.chat_format=toy, for the toy's models
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # orbax logs every checkpoint step through absl at INFO; keep the progress bars readable.
    logging.getLogger("absl").setLevel(logging.WARNING)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
