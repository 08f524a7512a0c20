"""Rollout step time of 2 JAX processes on a skewed step: each host's fixed block of the
questions (static) against questions taken from a shared queue as rows free up (balanced,
`rstar2_jax.parallel.hosts.claims`).

    python experiments/benchmarks/bench_balanced_rollouts.py [--repeats 3] [--tool-s 1.0]

The policy is the tests' scripted one (`tests/scripted_policy.py`: the real engine, host loop,
sandbox and chat format; the "model" replays fixed turns), so the figures measure scheduling,
not the model: of the step's 8 questions x 2 samples, the first 4 questions (process 0's static
block) make two tool calls that each sleep ``--tool-s`` seconds, the last 4 answer at once. Each
host decodes 2 rows at a time with a 2-worker sandbox pool. Per mode it prints the medians over
the repeats of the step's rollout time (the slowest host's), of the step time until every host
has every trajectory (`hosts.gather_questions`) and how many questions each host took, and
checks that both modes gather the same trajectories.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

QUESTIONS, SAMPLES, ROWS = 8, 2, 2


def worker(repeats: int, tool_s: float) -> None:
    from rstar2_jax.parallel.distributed import initialize_from_env

    initialize_from_env()
    import jax
    import numpy as np

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from scripted_policy import FORMAT, make_policy, prompts_for

    from rstar2_jax import chat
    from rstar2_jax.parallel import hosts
    from rstar2_jax.sampler import (AgentSampler, RolloutLimits, RolloutSettings, SamplingParams,
                                    Trajectory)
    from rstar2_jax.sandbox import SandboxPool
    from rstar2_jax.toy.tokenizer import build_tokenizer

    slow = chat.format_tool_call(f"import time\ntime.sleep({tool_s})\nprint(1)")
    scripts = [[slow, slow, "<answer>\\boxed{1}</answer>"], ["</reason><answer>\\boxed{3}</answer>"]]
    tokenizer = build_tokenizer(["Let me compute this with Python. print(6*7) answer boxed",
                                 FORMAT.prompt_text("q")] * 20 + [slow] * 5, vocab_size=400)
    config, params, forward, markers = make_policy(tokenizer, scripts)
    prompts = prompts_for(tokenizer, markers, [0] * (QUESTIONS // 2) + [1] * (QUESTIONS // 2))
    results = {}
    with SandboxPool(num_workers=2, timeout_s=30.0) as pool:
        sampler = AgentSampler(
            config, tokenizer, pool, RolloutSettings(num_slots=ROWS, num_rows=ROWS, chunk=16,
                                                     show_tool_time=False),
            RolloutLimits(max_turns=4, max_response_tokens=600, max_prompt_tokens=64),
            SamplingParams(temperature=0.0), forward_fn=forward)
        sampler.rollout(params, prompts[:1] + prompts[-1:], SAMPLES)  # compile
        for mode in ("static", "balanced"):
            for repeat in range(repeats):
                if mode == "static":
                    block = iter(range(hosts.share(QUESTIONS).start, hosts.share(QUESTIONS).stop))
                    claim = lambda: next(block, None)  # noqa: E731
                else:
                    claim = hosts.claims(QUESTIONS)
                hosts.gather(np.zeros((1,)))  # start together
                start = time.perf_counter()
                trajs, _ = sampler.rollout(params, prompts, SAMPLES, seed=1, claim=claim)
                rollout_s = time.perf_counter() - start
                mine = {}
                for t in trajs:
                    mine.setdefault(t.prompt_index, []).append(t.record())
                step = hosts.gather_questions(QUESTIONS, mine)
                step_s = time.perf_counter() - start
                every = hosts.gather({"rollout_s": np.array([rollout_s]),
                                      "taken": np.array([len(mine)])})
                results.setdefault(mode, []).append(
                    (float(every["rollout_s"].max()), step_s, every["taken"].tolist(),
                     [Trajectory.from_record(t).response_ids for q in step for t in q]))
    if jax.process_index() == 0:
        (static, balanced) = results["static"], results["balanced"]
        assert all(r[3] == static[0][3] for r in static + balanced), "the modes' rollouts differ"
        for mode, runs in results.items():
            print(json.dumps({"mode": mode,
                              "rollout_s": round(statistics.median(r[0] for r in runs), 3),
                              "step_s": round(statistics.median(r[1] for r in runs), 3),
                              "questions_per_host": [r[2] for r in runs]}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tool-s", type=float, default=1.0)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.repeats, args.tool_s)
    from rstar2_jax.parallel.distributed import free_port

    address = f"127.0.0.1:{free_port()}"
    children = [subprocess.Popen(
        [sys.executable, __file__, "--worker", "--repeats", str(args.repeats),
         "--tool-s", str(args.tool_s)],
        env=dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1",
                 JAX_PLATFORMS="cpu", JAX_COORDINATOR_ADDRESS=address, JAX_NUM_PROCESSES="2",
                 JAX_PROCESS_ID=str(index))) for index in range(2)]
    codes = [c.wait() for c in children]
    if any(codes):
        sys.exit(f"a worker failed: exit statuses {codes}")
    print(f"load average (uptime): {os.getloadavg()}")


if __name__ == "__main__":
    main()
