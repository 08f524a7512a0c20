"""Verifier throughput on a GRPO-like batch: scores/s through VerifierPool (target >= 100).

A batch is `problems x rollouts` responses. Each problem has a gold answer drawn from a mix like
the paper's data (mostly integers, then fractions, radicals and pi, intervals and sets, and
symbolic expressions that need math-verify); each rollout boxes one of a few candidate
answers (equivalent rewrites of the gold or typical wrong answers), so answers repeat within a
group as they do in RL. Some rollouts are truncated before boxing anything.

Figures printed:
- cold batch: a fresh pool scores the batch (every distinct pair verified once): the RL case;
- warm batch: the same batch again: every response is read again by a worker, and every
  verification is a cache hit: the cost of reading plus the pool's bookkeeping;
- all-distinct: as many distinct pairs as the batch has, no repeats: the uncached worst case;
- in-process `score` on the distinct pairs, single process, for reference (also per CPU
  second: the figure to compare on a machine shared with other jobs);
- a hostile response (`<answer>` and 8000 unclosed `\\boxed{`): how long `submit` takes to
  return and the reward to arrive (the worker reads it; before, `submit` read it itself).

Usage: python experiments/benchmarks/bench_verifier.py [--problems 64] [--rollouts 16] [--workers 2]
"""

import argparse
import os
import random
import statistics
import time

from rstar2_jax.rewards import VerifierPool, score

REASONING = (
    "<reason>Let me set up the problem and check it with the tool.</reason>\n"
    "<tool_call>{\"name\": \"execute_python_code_with_standard_io\", \"arguments\": "
    "{\"code\": \"print(sum(range(10)))\", \"input\": \"\"}}</tool_call>\n"
    "<tool_response>Tool call success\nstdout: 45\n</tool_response>\n"
) + "<reason>" + "Continuing the computation step by step. " * 40 + "</reason>\n"


def _problem(rng: random.Random) -> tuple[str, list[str], list[str]]:
    """(gold, equivalent rewrites, wrong answers) for one random problem."""
    kinds = {"integer": 50, "fraction": 20, "radical": 10, "interval": 10, "expression": 10}
    kind = rng.choices(list(kinds), list(kinds.values()))[0]
    if kind == "integer":
        n = rng.randint(1, 99_999)
        right = [str(n), f"{n:,}", f"{n}.0", f"\\text{{{n}}}"]
        return str(n), right, [str(n + 1), str(n - 1), str(-n), str(2 * n)]
    if kind == "fraction":
        p, q = rng.randint(1, 50), rng.randint(51, 99)
        return (
            f"\\frac{{{p}}}{{{q}}}",
            [f"\\frac{{{p}}}{{{q}}}", f"\\dfrac{{{p}}}{{{q}}}", f"{p}/{q}"]
            + [f"\\frac{{{2 * p}}}{{{2 * q}}}"],
            [f"\\frac{{{q}}}{{{p}}}", f"\\frac{{{p + 1}}}{{{q}}}", f"{p / q:.4f}"],
        )
    if kind == "radical":
        a, b = rng.randint(2, 9), rng.choice([2, 3, 5, 6, 7])
        return (
            f"{a}\\sqrt{{{b}}}",
            [f"{a}\\sqrt{{{b}}}", f"\\sqrt{{{a * a * b}}}", f"\\frac{{{a * b}}}{{\\sqrt{{{b}}}}}"],
            [f"\\sqrt{{{a * b}}}", f"{a * b}", f"{a * b ** 0.5:.3f}", f"{a}\\pi"],
        )
    if kind == "interval":
        lo, hi = sorted(rng.sample(range(-20, 20), 2))
        return (
            f"[{lo}, {hi})",
            [f"[{lo}, {hi})", f"\\left[{lo},{hi}\\right)"],
            [f"({lo}, {hi})", f"[{lo}, {hi}]", f"\\{{{lo}, {hi}\\}}"],
        )
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    return (
        f"(x+{a})(x+{b})",
        [f"(x+{a})(x+{b})", f"x^2+{a + b}x+{a * b}", f"(x+{b})(x+{a})"],
        [f"x^2+{a * b}", f"(x+{a})^2", f"x^2+{a + b}x"],
    )


def make_batch(
    problems: int, rollouts: int, seed: int
) -> tuple[list[tuple[str, str]], list[float]]:
    """`problems * rollouts` (response, gold) pairs, each group drawing from ~7 candidate
    answers, and the reward each should get by construction."""
    rng = random.Random(seed)
    batch, labels = [], []
    for _ in range(problems):
        gold, right, wrong = _problem(rng)
        p_correct = rng.random()  # problems range from hard to easy, as in a GRPO batch
        for _ in range(rollouts):
            if rng.random() < 0.05:
                batch.append((REASONING + "<reason>Still computing", gold))  # truncated
                labels.append(0.0)
                continue
            correct = rng.random() < p_correct
            candidates = right if correct else wrong
            # Exponential ranks: a few answers dominate each group.
            answer = candidates[min(int(rng.expovariate(1.0)), len(candidates) - 1)]
            final = f"<answer>The answer is $\\boxed{{{answer}}}$.</answer>"
            batch.append((REASONING + final, gold))
            labels.append(float(correct))
    return batch, labels


def _report(label: str, count: int, seconds: float, extra: str = "") -> None:
    rate = count / seconds
    print(f"{label:<34} {count:>6} scores in {seconds:7.3f} s = {rate:9.1f} scores/s  {extra}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=64)
    parser.add_argument("--rollouts", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    batch, labels = make_batch(args.problems, args.rollouts, args.seed)
    print(
        f"machine: {os.cpu_count()} CPUs, shared with other jobs (figures are noisy); "
        f"{args.workers} verifier workers, timeout {args.timeout_s} s"
    )
    print(f"batch: {args.problems} problems x {args.rollouts} rollouts = {len(batch)} responses")

    start = time.perf_counter()
    with VerifierPool(num_workers=args.workers, timeout_s=args.timeout_s) as pool:
        print(f"pool start-up: {time.perf_counter() - start:.2f} s (once per training run)")
        start = time.perf_counter()
        cold = pool.score_batch(batch)
        cold_s = time.perf_counter() - start
        stats = pool.stats()
        _report(
            "cold batch (GRPO, answers repeat)", len(batch), cold_s,
            f"[{stats.verified} verified, {stats.cache_hits} cache hits, "
            f"{stats.no_answer} unboxed, "
            f"{stats.timeouts} timeouts; mean reward {statistics.fmean(cold):.3f}]",
        )
        start = time.perf_counter()
        warm = pool.score_batch(batch)
        _report("warm batch (all cached)", len(batch), time.perf_counter() - start)
        assert warm == cold
        pairs = zip(batch, cold, labels)
        wrong = [(text[-60:], gold) for (text, gold), got, want in pairs if got != want]
        agree = len(batch) - len(wrong)
        print(f"rewards agreeing with the generator's labels: {agree}/{len(batch)} {wrong[:5]}")

    # Worst case: no repeats at all (fresh pool, so nothing is cached).
    unique, _ = make_batch(len(batch), 1, args.seed + 1)
    with VerifierPool(num_workers=args.workers, timeout_s=args.timeout_s) as pool:
        start = time.perf_counter()
        pool.score_batch(unique)
        stats = pool.stats()
        _report(
            "all-distinct batch (no cache help)", len(unique), time.perf_counter() - start,
            f"[{stats.verified} verified]",
        )

        start = time.perf_counter()
        future = pool.submit("<answer>" + "\\boxed{" * 8000, "5")
        returned_s = time.perf_counter() - start
        reward = future.result()
        total_s = time.perf_counter() - start
        print(
            f"hostile response (8000 unclosed boxes): submit returned in "
            f"{1e3 * returned_s:.2f} ms, reward {reward} after {1e3 * total_s:.1f} ms"
        )

    pairs = list(dict.fromkeys(batch))
    latencies = []
    cpu_start = time.process_time()
    for response, gold in pairs:
        start = time.perf_counter()
        score(response, gold)
        latencies.append(time.perf_counter() - start)
    cpu_s = time.process_time() - cpu_start
    latencies.sort()
    # On a shared machine the wall time counts other jobs' turns; the CPU time does not.
    _report(
        "in-process score, distinct pairs", len(pairs), sum(latencies),
        f"[p50 {1e3 * latencies[len(latencies) // 2]:.1f} ms, "
        f"p99 {1e3 * latencies[int(0.99 * (len(latencies) - 1))]:.1f} ms, 1 process; "
        f"{len(pairs) / cpu_s:.1f} scores per CPU second]",
    )


if __name__ == "__main__":
    main()
