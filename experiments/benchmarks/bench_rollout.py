"""Agentic rollout throughput and how long the model waits on tools.

    python -m rstar2_jax demo                       # once: writes runs/demo/sft_model
    python experiments/benchmarks/bench_rollout.py [--policy runs/demo/sft_model]

Runs the toy SFT policy (it calls the Python tool in most trajectories) on held-out toy problems
with the real sandbox, at several slot counts, and prints generated tokens/s, tool calls, the
mean tool latency and the fraction of rollout wall time during which no row could decode because
every live row waited on a tool. Next to it, plain `generate()` of the same prompts and samples
with the same model, slots, chunk, temperature and token budget (no tools: a row ends at its
first end of turn): the rollout phase's tokens/s as a fraction of it is what the agentic loop
(turns, tool calls, resumes, host bookkeeping) costs. Compilation is excluded (``--warmups``
untimed runs per setting, with other seeds); medians over repeats.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from rstar2_jax import chat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="runs/demo/sft_model")
    parser.add_argument("--problems", default="runs/demo/data/test.jsonl")
    parser.add_argument("--slots", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmups", type=int, default=3,
                        help="untimed runs first: each may meet new cache and resume buckets")
    args = parser.parse_args()
    if not Path(args.policy).exists():
        raise SystemExit(f"{args.policy} not found: run `python -m rstar2_jax demo` first")

    from transformers import AutoTokenizer

    from rstar2_jax.data.datasets import load_problems
    from rstar2_jax.model import load_hf
    from rstar2_jax.sampler import (
        AgentSampler,
        RolloutLimits,
        RolloutSettings,
        SamplingParams,
        generate,
    )
    from rstar2_jax.sandbox import SandboxPool
    from rstar2_jax.toy import TOY_FORMAT

    tokenizer = AutoTokenizer.from_pretrained(args.policy)
    config, params = load_hf(args.policy)
    problems = load_problems(args.problems)[: args.questions]
    prompts = [chat.encode_prompt(tokenizer, p.question, TOY_FORMAT) for p in problems]

    class TimedPool:
        """Records each call's latency (submit to result)."""

        def __init__(self, pool):
            self.pool, self.latencies = pool, []

        def submit(self, code, stdin=""):
            start = time.perf_counter()
            future = self.pool.submit(code, stdin)
            future.add_done_callback(
                lambda _: self.latencies.append(time.perf_counter() - start))
            return future

    def generate_tokens_per_s(slots: int, seed: int) -> float:
        start = time.perf_counter()
        out = generate(params, config, [p for p in prompts for _ in range(args.samples)], 320,
                       temperature=1.0, stop_tokens=sampler.stop_tokens, seed=seed,
                       num_slots=slots, chunk=32)
        return sum(len(g.tokens) for g in out) / (time.perf_counter() - start)

    print(f"{'slots':>5} {'tok/s':>7} {'calls':>6} {'tool ms':>8} {'tool wait':>10} "
          f"{'generate tok/s':>15} {'ratio':>6}")
    with SandboxPool(timeout_s=4.0) as pool:
        for slots in args.slots:
            timed = TimedPool(pool)
            sampler = AgentSampler(
                config, tokenizer, timed,
                RolloutSettings(show_tool_time=False, num_slots=slots, chunk=32),
                RolloutLimits(max_turns=4, max_response_tokens=320, max_prompt_tokens=64),
                SamplingParams(temperature=1.0))
            for seed in range(args.warmups):  # compile
                sampler.rollout(params, prompts, args.samples, seed=1000 + seed)
            runs = []
            for seed in range(args.repeats):
                timed.latencies.clear()
                _, stats = sampler.rollout(params, prompts, args.samples, seed=seed + 1)
                runs.append((stats.tokens_per_s, stats.tool_calls,
                             1000 * statistics.mean(timed.latencies or [0.0]),
                             stats.tool_wait_fraction))
            tok, calls, ms, wait = (statistics.median(x) for x in zip(*runs))
            for seed in range(args.warmups):  # compile
                generate_tokens_per_s(slots, 1000 + seed)
            plain = statistics.median(generate_tokens_per_s(slots, seed + 1)
                                      for seed in range(args.repeats))
            print(f"{slots:>5} {tok:>7.0f} {calls:>6.0f} {ms:>8.1f} {100 * wait:>9.1f}% "
                  f"{plain:>15.0f} {tok / plain:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
