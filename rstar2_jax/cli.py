"""Subcommands of ``python -m rstar2_jax``.

Training jobs take a YAML config and ``key=value`` overrides, checked against the job's frozen
dataclass (``rstar2_jax.train.configs``); a bad key or value stops with a message naming it::

    python -m rstar2_jax demo [--tiny] [out=runs/demo]
    python -m rstar2_jax sft --config experiments/paper/sft.yaml run_dir=runs/sft
    python -m rstar2_jax rl --config experiments/paper/stage1.yaml
    python -m rstar2_jax eval --config experiments/paper/eval_aime.yaml model.path=out/hf
    python -m rstar2_jax hard-subset --config experiments/paper/stage3.yaml
    python -m rstar2_jax export runs/sft/checkpoints out/hf [--step 300]
    python -m rstar2_jax scale-plan model=qwen3-14b devices=64 tp=1
    python -m rstar2_jax launch --processes 2 sft --config ...   # N processes of one run

Every job joins the run's other processes first when the environment describes several
(``rstar2_jax.parallel.distributed``).

A new job is one function here plus one ``add_parser`` line in ``main``.

Bad input (config, data, model, tokenizer, an output path that cannot be written) stops the job
with one line ``error: ...`` naming the file and what to change, exit status 2; ``--debug``
shows the traceback instead. Jobs check their inputs and output paths before any long work.

Ctrl-C, SIGTERM and SIGHUP stop a job the same way (`rstar2_jax.signals`): the save in flight
completes, the pools close, one line says how to resume, exit status 128 + the signal's number
(130, 143, 129).
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

from tqdm.contrib.logging import logging_redirect_tqdm

from rstar2_jax.config import load_config
from rstar2_jax.parallel.distributed import initialize_from_env, launch, require_single_process
from rstar2_jax.errors import (
    ConfigError,
    ModelError,
    UserError,
    require_writable_dir,
    require_writable_file,
)
from rstar2_jax.signals import Stopped, stop_on

# Jobs that run across processes; the others stop with a message when started as several.
_MULTI_PROCESS_JOBS = {"sft", "rl", "eval", "hard-subset"}


def _demo(args: argparse.Namespace) -> int:
    from rstar2_jax.toy.demo import RL_CHECKPOINT_EVERY, DemoConfig, run_demo

    config = load_config(DemoConfig.tiny() if args.tiny else DemoConfig, args.config, args.overrides)
    args.resume = (f"the newest checkpoints in {config.out} (SFT saves every {config.sft.checkpoint.every} "
                   f"steps, RL every {RL_CHECKPOINT_EVERY})")
    run_demo(config)
    return 0


def _sft(args: argparse.Namespace) -> int:
    from rstar2_jax.train.configs import SFTConfig
    from rstar2_jax.train.sft import run_sft

    config = load_config(SFTConfig, args.config, args.overrides)
    require_writable_dir(config.run_dir, "the run directory")
    args.resume = f"the newest checkpoint in {config.run_dir}"
    state = run_sft(config)
    print(f"SFT finished at step {int(state.step)}")
    return 0


def _rl(args: argparse.Namespace) -> int:
    from rstar2_jax.chat import get_format
    from rstar2_jax.data.datasets import load_problems
    from rstar2_jax.model.hf import read_hf_config
    from rstar2_jax.sampler.memory import preflight
    from rstar2_jax.tokenizer import open_tokenizer
    from rstar2_jax.train.configs import RLJobConfig
    from rstar2_jax.rl.loop import run_rl

    config = load_config(RLJobConfig, args.config, args.overrides)
    require_writable_dir(config.run_dir, "the run directory")
    # run_rl starts its sandbox and verifier pools first; check what it reads before that.
    open_tokenizer(config.model.path, config.model.tokenizer_path, get_format(config.model.chat_format))
    problems = load_problems(config.stage.dataset)
    if config.rl.questions_per_step > len(problems):
        raise ConfigError(f"rl.questions_per_step={config.rl.questions_per_step} exceeds the "
                          f"{len(problems)} problems of stage.dataset={config.stage.dataset}; "
                          f"lower it or use a larger dataset")
    preflight(config.precision.compute_config(read_hf_config(config.model.path)), config.rollout,
              config.limits)
    _require_previous_stage(config.stage.init_from)
    args.resume = f"the newest checkpoint in {config.run_dir}"
    state = run_rl(config)
    print(f"RL finished at step {int(state.step)}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from rstar2_jax.evaluate import run_eval, write_samples
    from rstar2_jax.model.hf import read_hf_config
    from rstar2_jax.sampler.memory import preflight
    from rstar2_jax.train.configs import EvalConfig

    config = load_config(EvalConfig, args.config, args.overrides)
    require_writable_file(config.output, "the evaluation output")
    preflight(read_hf_config(config.model.path), config.rollout, config.limits)
    report, records = run_eval(config)
    import jax  # joined the run's processes by now (main)

    if jax.process_index() == 0:  # every process has every record
        write_samples(config.output, records)
        print(report.summary())
        print(f"per-sample trajectories: {config.output}")
    return 0


def _hard_subset(args: argparse.Namespace) -> int:
    from rstar2_jax.evaluate import run_hard_subset
    from rstar2_jax.model.hf import read_hf_config
    from rstar2_jax.sampler.memory import preflight
    from rstar2_jax.train.configs import RLJobConfig

    config = load_config(RLJobConfig, args.config, args.overrides)
    if config.hard_subset is not None:
        require_writable_file(config.hard_subset.output, "the hard subset")
    preflight(read_hf_config(config.model.path), config.rollout, config.limits)
    _require_previous_stage(config.stage.init_from)
    kept, total = run_hard_subset(config)
    print(f"kept {kept} of {total} problems (not solved {config.hard_subset.samples}/"
          f"{config.hard_subset.samples}) in {config.hard_subset.output}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from rstar2_jax.train.checkpoint import export_hf

    step = export_hf(args.checkpoints, args.output, step=args.step, tokenizer=args.tokenizer,
                     dtype=args.dtype)
    print(f"exported step {step} of {args.checkpoints} to {args.output}")
    return 0


def _require_previous_stage(init_from: str | None) -> None:
    if init_from is not None and not (Path(init_from) / "checkpoints").is_dir():
        raise ModelError(f"stage.init_from={init_from} has no checkpoints directory (give the "
                         f"run_dir of the previous stage)")


def _scale_plan(args: argparse.Namespace) -> int:
    from rstar2_jax.rl.scale_plan import ScalePlanConfig, format_plan, run_in_subprocess

    config = load_config(ScalePlanConfig, args.config, args.overrides)
    print(format_plan(run_in_subprocess(config)))
    return 0


def _launch(args: argparse.Namespace) -> int:
    if not args.job:
        raise ConfigError("launch needs a job to run, e.g. `launch --processes 2 sft --config c.yaml`")
    return launch(args.processes, args.job, port=args.port)


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML file with the job's config")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides, applied after the file (e.g. optimizer.lr=1e-6)")


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def main(argv: list[str] | None = None) -> int:
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="on an error, show the traceback instead of one line")
    parser = argparse.ArgumentParser(prog="python -m rstar2_jax", parents=[debug])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", parents=[debug],
                          help="the main job: a CPU toy that trains in minutes")
    demo.add_argument("--tiny", action="store_true",
                      help="the smallest run that learns (DemoConfig.tiny, out=runs/demo_tiny): "
                           "about a minute on 2 cores; the config file and overrides apply on top")
    _add_config_args(demo)
    demo.set_defaults(func=_demo)

    sft = sub.add_parser("sft", parents=[debug], help="supervised fine-tuning on chat-formatted JSONL")
    _add_config_args(sft)
    sft.set_defaults(func=_sft)

    rl = sub.add_parser("rl", parents=[debug], help="one GRPO-RoC stage (rollouts, RoC, updates)")
    _add_config_args(rl)
    rl.set_defaults(func=_rl)

    evaluation = sub.add_parser("eval", parents=[debug],
                                help="average pass@1 / pass@k of a policy on a problem set")
    _add_config_args(evaluation)
    evaluation.set_defaults(func=_eval)

    hard = sub.add_parser("hard-subset", parents=[debug],
                          help="the problems a stage's starting policy does not solve k/k (its "
                               "hard_subset section)")
    _add_config_args(hard)
    hard.set_defaults(func=_hard_subset)

    export = sub.add_parser("export", parents=[debug], help="write a checkpoint as a Hugging Face model")
    export.add_argument("checkpoints", help="a run's checkpoints directory (<run_dir>/checkpoints)")
    export.add_argument("output", help="directory for config.json + model.safetensors")
    export.add_argument("--step", type=int, help="checkpoint step (default: newest readable)")
    export.add_argument("--dtype", choices=["float32", "bfloat16"],
                        help="dtype of the written weights (default: the run's master weights', "
                             "float32 unless precision.params said otherwise)")
    export.add_argument("--tokenizer", help="copy the tokenizer from this directory (default: the "
                                            "one of the model the run started from)")
    export.set_defaults(func=_export)

    plan = sub.add_parser("scale-plan", parents=[debug],
                          help="per-device memory of the RL step at scale, compiled on fake "
                               "devices without weights")
    _add_config_args(plan)
    plan.set_defaults(func=_scale_plan)

    launcher = sub.add_parser("launch", help="run a job as N processes of one run on this machine")
    launcher.add_argument("--processes", type=int, required=True, help="number of processes")
    launcher.add_argument("--port", type=int, help="coordinator port (default: a free one)")
    launcher.add_argument("job", nargs=argparse.REMAINDER, help="the job and its arguments")
    launcher.set_defaults(func=_launch)

    args = parser.parse_args(argv)
    # transformers' import-time advice ("PyTorch was not found...") concerns its models, which
    # no job uses; its warnings stay.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    import rstar2_jax.toy.format  # noqa: F401  registers model.chat_format=toy, for the toy's models
    # Our own INFO lines, and only the warnings of the libraries (JAX logs its backend probing,
    # orbax every checkpoint step, at INFO).
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("rstar2_jax").setLevel(logging.INFO)
    try:
        if args.func is not _launch:
            initialize_from_env()
            if args.command not in _MULTI_PROCESS_JOBS:
                require_single_process(args.command)
        # A line logged while a progress bar is drawn goes above the bar, not into it.
        with logging_redirect_tqdm(), stop_on(signal.SIGTERM, signal.SIGHUP):
            return args.func(args)
    except (UserError, OSError) as e:
        # An OSError without a file name is not about the user's input: keep its traceback.
        if getattr(args, "debug", False) or not (isinstance(e, UserError) or e.filename):
            raise
        message = _one_line(e) if isinstance(e, UserError) else \
            f"cannot access {e.filename}: {e.strerror or _one_line(e)}"
        print(f"error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        if getattr(args, "debug", False):
            raise
        signum = e.signum if isinstance(e, Stopped) else signal.SIGINT
        resume = getattr(args, "resume", None)
        print(("interrupted; " if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}; ")
              + (f"run the same command again to resume from {resume}" if resume
                 else "nothing to resume, run the command again"), file=sys.stderr)
        return 128 + signum
