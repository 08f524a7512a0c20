"""Host time of one RL step's selection and advantages (`rl_data.select_rollouts`), and the
programs JAX compiles for them, over a run whose kept-group count changes from step to step.

    python experiments/benchmarks/bench_selection.py [--steps 40] [--passes 2] [--shapes toy paper]

Each step gets made-up `Rollouts` of the step's `[questions, n]` shape, filled as the sampler's
records fill them (`rl_data.rollout_arrays`): tool calls, failed calls, answer blocks and turns
per rollout, a reward of 1 only for an untruncated rollout with an answer block. Each step draws
the share of questions whose n rewards are all equal (all solved or all failed: the groups the
equal-reward filter drops) uniformly in [0.05, 0.95], so the kept-group count wanders over most
of its range, as it does in a run while the policy learns.

Shapes: "toy" is the demo's (`rstar2_jax.toy.demo.DemoConfig`: 32 questions x 8 rollouts,
G = 4), "paper" rStar2-Agent's (512 questions x 32 rollouts, G = 16). Algorithms: GRPO-RoC
(`grpo_roc`) and plain GRPO (`grpo`), each in a fresh state of JAX's in-memory caches (the
persistent cache is off here, as in a process without ``enable_persistent_cache``).

Per (shape, algorithm) it prints the first call (step 0), then for each pass over the steps
(a second pass runs the same steps again and meets only kept counts it has seen): the total
time, the programs XLA compiled (`rstar2_jax.compile_cache.CompileCounter`) with the compile
seconds, split between the algorithm's select and its advantages (with the wall seconds of
each), and the median time per step, over all steps, over those that compiled something and
over those that did not (the steady state). Figures are wall-clock on a shared machine: noisy.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import jax
import numpy as np

from rstar2_jax.algorithms import Algorithm, Rollouts, resolve_algorithm
from rstar2_jax.compile_cache import CompileCounter
from rstar2_jax.rl.data import select_rollouts

SHAPES = {"toy": (32, 8, 4), "paper": (512, 32, 16)}


def make_rollouts(rng: np.random.Generator, questions: int, n: int) -> Rollouts:
    """`[questions, n]` rollouts like `rollout_arrays` builds, a random share of whose questions
    have n equal rewards."""
    shape = (questions, n)
    # Questions range from hard to easy; a share of them is solved by every rollout or by none.
    solve = rng.random(questions)
    equal = rng.random(questions) < rng.uniform(0.05, 0.95)
    solve[equal] = rng.integers(0, 2, int(equal.sum()))
    always = (solve == 1)[:, None]
    tool_calls = rng.poisson(2.0, shape).astype(np.int32)
    tool_errors = rng.binomial(tool_calls, 0.3).astype(np.int32)
    # The released rule's test ("error" in the response) misses timeouts and catches a few prints.
    tool_error_mentions = np.minimum(tool_calls, rng.binomial(tool_errors, 0.9)
                                     + rng.binomial(tool_calls - tool_errors, 0.05)).astype(np.int32)
    truncated = (rng.random(shape) < 0.05) & ~always
    answer_blocks = np.where(truncated, 0, rng.choice([0, 1, 1, 1, 1, 1, 2], shape)).astype(np.int32)
    answer_blocks[always & (answer_blocks == 0)] = 1
    answer_tags = (2 * answer_blocks + (rng.random(shape) < 0.02)).astype(np.int32)
    turns = (tool_calls + 1).astype(np.int32)
    lengths = rng.integers(50, 4000, shape).astype(np.int32)
    # A reward of 1 needs a finished rollout with an answer block.
    correct = (rng.random(shape) < solve[:, None]) & ~truncated & (answer_blocks > 0)
    rewards = correct.astype(np.float32)
    return Rollouts(rewards=rewards, lengths=lengths, truncated=truncated, tool_calls=tool_calls,
                    tool_errors=tool_errors, tool_error_mentions=tool_error_mentions,
                    answer_blocks=answer_blocks, answer_tags=answer_tags, turns=turns)


class Phases:
    """The algorithm's select and advantages, each timed with the programs it compiled."""

    def __init__(self, algorithm: Algorithm, counter: CompileCounter):
        self.counter, self.record = counter, {}
        self.algorithm = dataclasses.replace(algorithm, select=self._timed("select", algorithm.select),
                                             advantages=self._timed("advantages", algorithm.advantages))

    def _timed(self, phase, fn):
        def timed(*args):
            before, start = self.counter.snapshot(), time.perf_counter()
            out = fn(*args)
            self.record[phase] = (time.perf_counter() - start, (self.counter.snapshot() - before).compiled)
            return out
        return timed


def _ms(values: list[float]) -> str:
    return f"{1e3 * statistics.median(values):7.1f} ms" if values else "    n/a   "


def run(name: str, shape: str, steps: int, passes: int, seed: int) -> None:
    questions, n, group_size = SHAPES[shape]
    rng = np.random.default_rng(seed)
    step_rollouts = [make_rollouts(rng, questions, n) for _ in range(steps)]
    key = jax.random.key(seed)
    jax.clear_caches()
    print(f"\n{name} at {shape} ({questions} questions x {n} rollouts, G = {group_size}), {steps} steps")
    with CompileCounter() as counter:
        phases = Phases(resolve_algorithm(name), counter)
        for p in range(passes):
            times, compiling, clean, groups = [], [], [], set()
            programs = {"select": 0, "advantages": 0}
            seconds_in = {"select": 0.0, "advantages": 0.0}
            before_pass = counter.snapshot()
            for step, rollouts in enumerate(step_rollouts):
                step_key = jax.random.fold_in(key, step)
                before = counter.snapshot()
                phases.record = {}
                start = time.perf_counter()
                kept = select_rollouts(phases.algorithm, step_key, rollouts, group_size)
                seconds = time.perf_counter() - start
                new = counter.snapshot() - before
                for phase, (phase_s, compiled) in phases.record.items():
                    programs[phase] += compiled
                    seconds_in[phase] += phase_s
                times.append(seconds)
                groups.add(kept.groups)
                (compiling if new.compiled else clean).append(seconds)
                if p == 0 and step == 0:
                    print(f"  first call: {1e3 * seconds:8.1f} ms, compiled {new.compiled} programs "
                          f"({new.compile_s:.2f} s compiling, {new.trace_s:.2f} s tracing), "
                          f"{kept.groups} groups kept")
            total = counter.snapshot() - before_pass
            print(f"  pass {p + 1}: {len(groups)} distinct kept counts ({min(groups)}-{max(groups)}); "
                  f"total {sum(times):6.2f} s, {total.compiled} programs compiled in "
                  f"{total.compile_s:5.2f} s (select {programs['select']} in {seconds_in['select']:5.2f} s "
                  f"wall, advantages {programs['advantages']} in {seconds_in['advantages']:5.2f} s wall)\n"
                  f"          per step: median {_ms(times)}, max {1e3 * max(times):7.1f} ms; median "
                  f"{_ms(compiling)} over the {len(compiling)} steps that compiled, {_ms(clean)} over "
                  f"the {len(clean)} that did not")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="steps per pass (the demo runs 40)")
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--algorithms", nargs="+", default=["grpo_roc", "grpo"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"machine: {os.cpu_count()} CPUs, shared with other jobs (figures are noisy); "
          f"JAX {jax.__version__} on {jax.devices()[0].platform}")
    for shape in args.shapes:
        for name in args.algorithms:
            run(name, shape, args.steps, args.passes, args.seed)


if __name__ == "__main__":
    main()
