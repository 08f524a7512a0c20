"""RL step time and each side's idle share at ``rl.max_staleness`` = k, one process.

    python experiments/benchmarks/bench_async_rl.py [--staleness 0 1 2] [--steps 8] [--skip 2]

The toy of ``python -m rstar2_jax demo --tiny`` (its SFT policy, built once under
``--out``, a 1-layer Qwen3 of hidden 32), trained by RL with the main demo's step shape
(32 questions x 8 rollouts, G = 4, at most 160 response tokens, 2 turns) for ``--steps`` steps
per setting from the same SFT policy. Per setting it prints the median over the steps after the
first ``--skip`` (compilation) of the step time (wall time between two finished steps), the
rollout and update times, and each side's idle time and share of the step:
``time/trainer_wait_s`` (the trainer waiting for rollouts) and ``time/sampler_wait_s`` (the
sampler waiting for a policy version; at k = 0, the update it waits for).
"""
from __future__ import annotations

import argparse
import dataclasses
import shutil
import statistics
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--skip", type=int, default=2)
    parser.add_argument("--out", default="runs/bench_async_rl")
    args = parser.parse_args()

    from rstar2_jax.runtime import RolloutRuntime
    from rstar2_jax.sandbox import SandboxPool
    from rstar2_jax.toy.demo import DemoConfig, rl_config, train_sft_policy
    from rstar2_jax.train.rl import run_rl

    tiny = DemoConfig.tiny(args.out)
    cfg = dataclasses.replace(tiny, rl=dataclasses.replace(
        DemoConfig().rl, max_prompt_tokens=tiny.rl.max_prompt_tokens), rl_steps=args.steps)
    out = Path(cfg.out)
    if not (out / "sft_model").exists():
        with SandboxPool(num_workers=1, timeout_s=cfg.rollout.tool_timeout_s) as sandbox:
            train_sft_policy(tiny, sandbox, progress=False)
    rows = []
    with RolloutRuntime(cfg.rollout) as runtime:
        for k in args.staleness:
            name = f"rl_k{k}"
            shutil.rmtree(out / name, ignore_errors=True)
            config = rl_config(cfg, out, name)
            config = dataclasses.replace(config, rl=dataclasses.replace(config.rl, max_staleness=k))
            finished, metrics = [time.perf_counter()], []

            def on_step(step, m, finished=finished, metrics=metrics):
                finished.append(time.perf_counter())
                metrics.append(m)

            run_rl(config, runtime=runtime, on_step=on_step, progress=False)
            steps = [b - a for a, b in zip(finished, finished[1:])][args.skip:]
            kept = metrics[args.skip:]
            med = lambda key: statistics.median(m[key] for m in kept)  # noqa: E731
            step_s = statistics.median(steps)
            rows.append(f"| {k} | {step_s:.2f} | {med('time/rollout_s'):.2f} | "
                        f"{med('time/update_s'):.2f} | {med('time/trainer_wait_s'):.2f} "
                        f"({med('time/trainer_wait_s') / step_s:.0%}) | "
                        f"{med('time/sampler_wait_s'):.2f} ({med('time/sampler_wait_s') / step_s:.0%}) | "
                        f"{max(m['staleness/max'] for m in kept):.0f} | "
                        f"{statistics.mean(m['reward/mean'] for m in metrics):.3f} |")
            print(rows[-1], flush=True)
    print("| k | step s | rollout s | update s | trainer idle s (share) | sampler idle s (share) "
          "| staleness max | reward mean (all steps) |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
