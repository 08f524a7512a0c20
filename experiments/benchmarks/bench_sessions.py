"""Tool sessions against stateless calls: calls/s and CPU per call at a trajectory's turn counts.

A trajectory of T turns makes T calls, one after another (the model reads each output before the
next call); ``--concurrency`` trajectories run at once, as rows of a rollout do. The same cells run
both ways:
  stateless   each cell is a fresh program (rStar2's training tool)
  session     the cells of a trajectory share one session: call t replays the t-1 cells before it
Cells:
  toy         the testbed's cells: a few assignments and one line of integer arithmetic
  math        the math mix of bench_sandbox.py (sympy solve, numpy linear algebra, fractions, ...)
The stateless figure is also the most a per-trajectory forked process could reach: it too needs
one fork and the new cell per call, and skips only the replay.

Usage: python experiments/benchmarks/bench_sessions.py [--turns 1 2 3 10] [--rounds 2]
"""
from __future__ import annotations

import argparse
import os
import statistics

from bench_sandbox import MATH_MIX, closed_loop, template_cpu_s

from rstar2_jax.sandbox import SandboxPool


def toy_cells(trajectory: int, turns: int) -> dict[str, list[str]]:
    """A toy trajectory: assignments, then each turn one line of arithmetic on the names they
    define. Stateless, each call must define the names again."""
    setup = f"a = {123457 + trajectory}\nb = {654321 + trajectory}\nm = 997\n"
    cells = ["print(a * b % m)"] + [f"x{t} = (a + {t}) * b % m\nprint(x{t})" for t in range(1, turns)]
    return {"stateless": [setup + c for c in cells], "session": [setup + cells[0]] + cells[1:]}


def math_cells(trajectory: int, turns: int) -> dict[str, list[str]]:
    cells = [MATH_MIX[(trajectory + t) % len(MATH_MIX)] for t in range(turns)]
    return {"stateless": cells, "session": cells}


def run(pool: SandboxPool, mode: str, trajectories: list[list[str]], concurrency: int) -> tuple[float, float, bool]:
    """(calls/s, CPU ms per call, every call ok) of running ``trajectories`` ``concurrency`` at a
    time, ``mode`` "stateless" or "session"."""
    def trajectory(cells: list[str]) -> bool:
        if mode == "stateless":
            return all(pool.run(c).ok for c in cells)
        with pool.session() as session:
            return all(session.run(c).ok for c in cells)

    pids = pool.health()["template_pids"]
    cpu = template_cpu_s(pids)
    seconds, _, oks = closed_loop(trajectory, trajectories, concurrency)
    calls = sum(len(t) for t in trajectories)
    return calls / seconds, (template_cpu_s(pids) - cpu) / calls * 1e3, all(oks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=None, help="template processes (default: cores)")
    parser.add_argument("--concurrency", type=int, default=8, help="trajectories in flight")
    parser.add_argument("--calls", type=int, default=240, help="calls per measurement (about)")
    parser.add_argument("--turns", type=int, nargs="+", default=[1, 2, 3, 10])
    parser.add_argument("--rounds", type=int, default=2, help="alternating repetitions; medians reported")
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()}")
    with SandboxPool(num_workers=args.workers, timeout_s=30.0) as pool:
        print(f"pool: {pool.num_workers} templates, isolation={pool.health()['isolation']}, "
              f"{args.concurrency} trajectories in flight")
        pool.run_batch(MATH_MIX * 2)  # first calls touch lazily created pages and caches
        print("| cells | turns | stateless calls/s (CPU ms/call) | session calls/s (CPU ms/call) | session / stateless |")
        print("|---|---|---|---|---|")
        for name, make in (("toy", toy_cells), ("math", math_cells)):
            for turns in args.turns:
                trajectories = [make(i, turns) for i in range(max(1, args.calls // turns))]
                figures = {"stateless": [], "session": []}
                for _ in range(args.rounds):
                    for mode in figures:
                        rate, cpu, ok = run(pool, mode, [t[mode] for t in trajectories], args.concurrency)
                        assert ok, f"a {mode} call of the {name} cells failed"
                        figures[mode].append((rate, cpu))
                med = {mode: (statistics.median(r for r, _ in v), statistics.median(c for _, c in v))
                       for mode, v in figures.items()}
                print(f"| {name} | {turns} | {med['stateless'][0]:.1f} ({med['stateless'][1]:.1f}) | "
                      f"{med['session'][0]:.1f} ({med['session'][1]:.1f}) | "
                      f"{med['session'][0] / med['stateless'][0]:.2f} |", flush=True)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
