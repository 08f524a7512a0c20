"""CPU isolation of sandboxed calls: what a CPU-hogging call costs its neighbours.

A hog call runs for its whole deadline in one of three shapes:
  spin          one process in a busy loop
  forks         16 forked children in busy loops (one session)
  setsid forks  16 forked children that each call ``setsid()`` first, then loop (under kernel
                autogroup scheduling each new session is a scheduling group of its own)
Beside each, and alone, two things are timed at the same time:
  neighbour     the wall time of a CPU-bound call (a Python loop) submitted to the same pool
  trainer       a shorter CPU-bound Python loop in this process, standing for the trainer, run
                while the neighbour call runs
Figures are medians over ``--repeats``; the ratio to the same measure without a hog, taken in
the same run, is what to compare across machines.

Usage: python experiments/benchmarks/bench_sandbox_fairness.py [--workers N] [--repeats 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from rstar2_jax.sandbox import SandboxPool

HOGS = {
    "spin": "while True: pass",
    "forks": "import os\nfor _ in range(16):\n    if os.fork() == 0:\n        break\nwhile True: pass",
    "setsid forks": ("import os\nfor _ in range(16):\n    if os.fork() == 0:\n        os.setsid()\n        break\n"
                     "while True: pass"),
}


def neighbour_code(n: int) -> str:
    return f"t = 0\nfor i in range({n}):\n    t += i\nprint(t)"


def trainer_loop(n: int) -> float:
    start = time.perf_counter()
    t = 0
    for i in range(n):
        t += i
    return time.perf_counter() - start


def _autogroup() -> str:
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            return "on" if f.read().strip() == "1" else "off"
    except OSError:
        return "absent"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=None, help="template processes (default: cores)")
    parser.add_argument("--timeout-s", type=float, default=4.0, help="the pool's deadline (rStar2: 4 s)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--neighbour-iters", type=int, default=10_000_000)
    parser.add_argument("--trainer-iters", type=int, default=3_000_000)
    args = parser.parse_args()

    with SandboxPool(num_workers=args.workers, timeout_s=args.timeout_s) as pool:
        health = pool.health()
        print(f"pool: {pool.num_workers} templates, isolation {health['isolation']}, memory bound "
              f"{health['memory_limit']}, CPU bound {health['cpu_limit']}; {os.cpu_count()} CPUs, "
              f"kernel autogroup {_autogroup()}; load average {os.getloadavg()[0]:.2f}")
        neighbour = neighbour_code(args.neighbour_iters)
        pool.run(neighbour)  # warm
        rows = []
        for hog_name in [None, *HOGS]:
            walls, statuses, loops = [], [], []
            for _ in range(args.repeats):
                hog = pool.submit(HOGS[hog_name]) if hog_name else None
                if hog is not None:
                    time.sleep(0.3)  # let it fork and spin up
                call = pool.submit(neighbour)
                loops.append(trainer_loop(args.trainer_iters))  # while the hog and the neighbour run
                result = call.result()
                walls.append(result.wall_s)
                statuses.append(result.status)
                if hog is not None:
                    hog_result = hog.result()
                    assert hog_result.status == "timeout", hog_result
            rows.append((hog_name or "no hog", statistics.median(walls), statuses, statistics.median(loops)))
        base_wall, base_loop = rows[0][1], rows[0][3]
        print(f"{'beside':14s} {'neighbour call wall':>20s} {'x alone':>8s} {'trainer loop':>13s} {'x alone':>8s}  "
              f"neighbour statuses")
        for name, wall, statuses, loop in rows:
            print(f"{name:14s} {wall:19.3f}s {wall / base_wall:8.2f} {loop:12.3f}s {loop / base_loop:8.2f}  "
                  f"{','.join(statuses)}")
        print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
