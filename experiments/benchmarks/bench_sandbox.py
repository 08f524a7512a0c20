"""Sandbox pool throughput and latency against a fresh ``python -c`` per call.

Workloads, each run as a closed loop with the same number of calls in flight for both backends:
  trivial      print(i)
  math_mix     a realistic mix of math tool calls (sympy solve, numpy linear algebra, fractions,
               combinatorics, plain loops), each importing what it uses
  numpy_sympy  calls that import numpy and sympy (what most math tool calls do)
Pool overhead is the end-to-end latency of a call that does nothing, one call at a time.
CPU per call (templates, their zygotes and the calls, from /proc) does not depend on how busy
the host is, so ``cores / cpu_per_call`` estimates the throughput of an idle machine.

Usage: python experiments/benchmarks/bench_sandbox.py [--workers N] [--concurrency C]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time

from rstar2_jax.sandbox import SandboxPool

MATH_MIX = [
    "print(sum(i * i for i in range(20000)))",
    "import math\nprint(math.comb(60, 30), math.factorial(25) % 1000003)",
    "import sympy as sp\nx = sp.Symbol('x')\nprint(sp.solve(x**3 - 6*x**2 + 11*x - 6, x))",
    "import numpy as np\na = np.arange(64.0).reshape(8, 8) + np.eye(8) * 50\n"
    "print(round(float(np.linalg.det(a)), 3), np.linalg.solve(a, np.ones(8))[:2])",
    "from fractions import Fraction\nprint(sum(Fraction(1, k * (k + 1)) for k in range(1, 200)))",
    "import itertools\nprint(sum(1 for p in itertools.permutations(range(7)) if p[0] < p[-1]))",
    "import sympy as sp\nprint(sp.factorint(2**32 + 1), sp.isprime(10**9 + 7))",
    "import numpy as np\nv = np.linalg.eigvalsh(np.array([[2., 1.], [1., 2.]]))\nprint(v)",
]
NUMPY_SYMPY = [
    "import numpy as np\nimport sympy as sp\nx = sp.Symbol('x')\n"
    "print(sp.Poly(x**2 - 3*x + 2).all_roots(), int(np.sum(np.arange(10) ** 2)))",
]


def closed_loop(run_one, calls: list[str], concurrency: int) -> tuple[float, list[float], list[bool]]:
    """Run ``calls`` keeping ``concurrency`` in flight; return (seconds, latencies, ok flags)."""
    latencies, oks, lock, it = [], [], threading.Lock(), iter(calls)

    def worker():
        while True:
            with lock:
                code = next(it, None)
            if code is None:
                return
            start = time.perf_counter()
            ok = run_one(code)
            with lock:
                latencies.append(time.perf_counter() - start)
                oks.append(ok)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start, latencies, oks


def fresh_python(code: str) -> bool:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    return proc.returncode == 0


def template_cpu_s(pids: list[int]) -> float:
    """utime + stime + cutime + cstime of the templates and their zygotes (the zygote forks and
    reaps the calls, so a call's CPU is counted in its cutime/cstime once it has ended)."""
    total = 0
    for template in pids:
        with open(f"/proc/{template}/task/{template}/children") as f:
            zygotes = [int(c) for c in f.read().split()]
        for pid in [template] + zygotes:
            with open(f"/proc/{pid}/stat") as f:
                total += sum(int(x) for x in f.read().rsplit(")", 1)[1].split()[11:15])
    return total / os.sysconf("SC_CLK_TCK")


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


def report(name: str, backend: str, seconds: float, latencies: list[float], oks: list[bool]) -> float:
    rate = len(latencies) / seconds
    print(f"{name:12s} {backend:13s} {len(latencies):5d} calls  {rate:8.1f} calls/s  "
          f"p50 {percentile(latencies, 50) * 1e3:7.1f} ms  p99 {percentile(latencies, 99) * 1e3:7.1f} ms"
          + ("" if all(oks) else f"  FAILED {oks.count(False)}"))
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=None, help="template processes (default: cores)")
    parser.add_argument("--concurrency", type=int, default=8, help="calls in flight, both backends")
    parser.add_argument("--pool-calls", type=int, default=400)
    parser.add_argument("--fresh-calls", type=int, default=40)
    args = parser.parse_args()

    workloads = {
        "trivial": [f"print({i})" for i in range(args.pool_calls)],
        "math_mix": [MATH_MIX[i % len(MATH_MIX)] for i in range(args.pool_calls)],
        "numpy_sympy": NUMPY_SYMPY * args.pool_calls,
    }
    with SandboxPool(num_workers=args.workers, timeout_s=10.0) as pool:
        print(f"pool: {pool.num_workers} templates, isolation={pool.health()['isolation']}, "
              f"concurrency {args.concurrency}")
        pool.run_batch(MATH_MIX * 2)  # first calls touch lazily created pages and caches

        def pooled(code):
            return pool.run(code).status == "ok"

        _, overhead, _ = closed_loop(pooled, ["pass"] * 200, concurrency=1)
        print(f"pool overhead (no-op call, one at a time): p50 {percentile(overhead, 50) * 1e3:.1f} ms  "
              f"p99 {percentile(overhead, 99) * 1e3:.1f} ms")
        pids = pool.health()["template_pids"]
        for name, calls in workloads.items():
            cpu_before = template_cpu_s(pids)
            pool_rate = report(name, "pool", *closed_loop(pooled, calls, args.concurrency))
            cpu_per_call = (template_cpu_s(pids) - cpu_before) / len(calls)
            print(f"{name:12s} pool CPU per call {cpu_per_call * 1e3:.1f} ms -> "
                  f"~{len(os.sched_getaffinity(0)) / cpu_per_call:.0f} calls/s on these cores if idle")
            fresh_rate = report(name, "fresh python", *closed_loop(fresh_python, calls[: args.fresh_calls],
                                                                     args.concurrency))
            print(f"{name:12s} speedup {pool_rate / fresh_rate:.1f}x")
        stats = pool.stats()
        print(f"pool stats: {stats['completed']} calls, statuses ok={stats['ok']} error={stats['error']} "
              f"timeout={stats['timeout']} sandbox_error={stats['sandbox_error']}, "
              f"queue wait p99 {stats['queue_wait_p99_s'] * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
