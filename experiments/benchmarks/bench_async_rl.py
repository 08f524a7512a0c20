"""RL step time and each side's idle share at ``rl.max_staleness`` = k, by device layout.

    python experiments/benchmarks/bench_async_rl.py [--staleness 0 1 2] [--layouts 1x1 1x2:1 2x2:1]
        [--steps 8] [--skip 2] [--padded]

The toy of ``python -m rstar2_jax demo --tiny`` (its SFT policy, built once under ``--out``, a
1-layer Qwen3 of hidden 32), trained by RL with the main demo's step shape (32 questions x 8
rollouts, G = 4, at most 160 response tokens, 2 turns) for ``--steps`` steps per setting from
the same SFT policy. A layout ``PxD[:R]`` runs the job as P processes on this machine (JAX's
distributed runtime on localhost) with D fake CPU devices each, R of which serve the sampler
(``mesh.rollout_devices``; the trainer's mesh is fsdp over the other devices of every process).
k > 0 on several processes needs R > 0; such settings are skipped.

Each setting runs twice, with JAX's persistent compilation cache in ``<out>/jax_cache``: the
runs are deterministic, so the second meets only programs the first compiled, and it alone is
reported (packed update batches take a new shape whenever a step packs into a new row count,
and each compilation would otherwise land in some step's update time). JAX writes cache
entries from process 0 only, so on several processes the others compile again: ``--padded``
trains on padded batches (``rl.packed=false``), whose few row buckets all compile within the
first steps, for a comparison of layouts that compilation does not blur.
Per setting it prints the median over the steps after the first ``--skip`` of the
step time (``time/step_s``: wall time between two logged steps), the rollout and update times,
the weight copy (``time/weight_copy_s``) and each side's idle time and share of the step:
``time/trainer_wait_s`` (the trainer waiting for rollouts) and ``time/sampler_wait_s`` (the
sampler waiting for a policy version; at k = 0, the update it waits for).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path


def layout(text: str) -> tuple[int, int, int]:
    """``PxD[:R]`` -> (processes, devices per process, rollout devices per process)."""
    shape, _, rollout = text.partition(":")
    processes, devices = (int(x) for x in shape.split("x"))
    return processes, devices, int(rollout or 0)


def tiny_config(out: str, steps: int):
    from rstar2_jax.toy.demo import DemoConfig

    tiny = DemoConfig.tiny(out)
    return dataclasses.replace(tiny, rl=dataclasses.replace(
        DemoConfig().rl, max_prompt_tokens=tiny.rl.max_prompt_tokens),
        stage=dataclasses.replace(tiny.stage, steps=steps))


def worker(args) -> None:
    """One process of a setting: the RL run, and (process 0) its per-step metrics as JSON."""
    from rstar2_jax.parallel.distributed import initialize_from_env

    initialize_from_env()
    import jax

    from rstar2_jax.compile_cache import enable_persistent_cache

    enable_persistent_cache()

    from rstar2_jax.toy.demo import rl_config
    from rstar2_jax.train.configs import MeshConfig
    from rstar2_jax.train.metrics import read_metrics
    from rstar2_jax.rl.loop import run_rl

    processes, devices, rollout = layout(args.layout)
    cfg = tiny_config(args.out, args.steps)
    name = f"rl_{args.layout.replace(':', 'r')}_k{args.k}"
    config = rl_config(cfg, Path(args.out), name)
    config = dataclasses.replace(
        config, rl=dataclasses.replace(config.rl, max_staleness=args.k, packed=not args.padded),
        mesh=MeshConfig(fsdp=processes * (devices - rollout), rollout_devices=rollout))
    run_rl(config, progress=False)
    if jax.process_index() == 0:
        Path(args.result).write_text(json.dumps(read_metrics(Path(args.out) / name)))


def run_setting(out: Path, text: str, k: int, steps: int, padded: bool) -> list[dict]:
    """Runs one setting as its processes; returns process 0's per-step metrics."""
    from rstar2_jax.parallel.distributed import free_port

    processes, devices, _ = layout(text)
    result = out / f"result_{text.replace(':', 'r')}_k{k}.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(out / "jax_cache"),
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    if processes > 1:
        env |= {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}",
                "JAX_NUM_PROCESSES": str(processes)}
    command = [sys.executable, __file__, "--worker", "--layout", text, "--k", str(k),
               "--steps", str(steps), "--out", str(out), "--result", str(result)] + ["--padded"] * padded
    for _ in range(2):  # the first run fills the compilation cache for the second
        shutil.rmtree(out / f"rl_{text.replace(':', 'r')}_k{k}", ignore_errors=True)
        children = [subprocess.Popen(command, env=env | {"JAX_PROCESS_ID": str(i)} if processes > 1 else env)
                    for i in range(processes)]
        codes = [child.wait() for child in children]
        if any(codes):
            raise SystemExit(f"setting {text} k={k}: exit statuses {codes}")
    return json.loads(result.read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--layouts", nargs="+", default=["1x1", "1x2:1", "2x2:1"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--skip", type=int, default=2)
    parser.add_argument("--out", default="runs/bench_async_rl")
    parser.add_argument("--padded", action="store_true", help="padded update batches (rl.packed=false)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layout", help=argparse.SUPPRESS)
    parser.add_argument("--k", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    out = Path(args.out)
    if not (out / "sft_model").exists():
        from rstar2_jax.sandbox import SandboxPool
        from rstar2_jax.toy.demo import DemoConfig, train_sft_policy

        tiny = DemoConfig.tiny(args.out)
        with SandboxPool(num_workers=1, timeout_s=tiny.rollout.sandbox.timeout_s) as sandbox:
            train_sft_policy(tiny, sandbox, progress=False)
    header = ("| layout | k | step s | rollout s | update s | weight copy s | trainer idle s (share) "
              "| sampler idle s (share) | staleness max | reward mean (all steps) |")
    rows = []
    for text in args.layouts:
        processes, _, rollout = layout(text)
        for k in args.staleness:
            if k and processes > 1 and not rollout:
                continue
            metrics = run_setting(out, text, k, args.steps, args.padded)
            kept = metrics[args.skip:]
            med = lambda key: statistics.median(m[key] for m in kept)  # noqa: E731
            step_s = med("time/step_s")
            rows.append(f"| {text} | {k} | {step_s:.2f} | {med('time/rollout_s'):.2f} | "
                        f"{med('time/update_s'):.2f} | {med('time/weight_copy_s'):.3f} | "
                        f"{med('time/trainer_wait_s'):.2f} ({med('time/trainer_wait_s') / step_s:.0%}) | "
                        f"{med('time/sampler_wait_s'):.2f} ({med('time/sampler_wait_s') / step_s:.0%}) | "
                        f"{max(m['staleness/max'] for m in kept):.0f} | "
                        f"{statistics.mean(m['reward/mean'] for m in metrics):.3f} |")
            print(rows[-1], flush=True)
    print(header)
    print("|" + "---|" * 10)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
