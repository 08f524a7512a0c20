"""Memory of a whole pool: what a batch of calls that each take their full limit leaves the trainer.

Every slot of the pool gets a call that fills its memory: three processes (the call and two
forked children), each appending 16 MiB blocks until it gets MemoryError (its address-space
limit) or the kernel kills it, then holding what it has for ``--hold-s``. Each call alone could
pass its own ``memory_bytes``, so its slot's cgroup holds it at that limit; together they ask
``workers x slots x memory_bytes``. Meanwhile this process, standing for the trainer, holds
``--trainer-mib`` of its own and the host's ``MemAvailable`` is sampled every 20 ms.

Printed per bound (the pool's ``pool_memory_bytes``, and "none": a bound as large as all the
calls together, as before the bound existed): the calls' statuses, the peak that the pool's
calls held together (the sum of the template groups' peak usage, cgroup v1; elsewhere the
sampled drop of MemAvailable is the figure), the largest drop of MemAvailable below its value
before the batch, and whether the trainer's memory is intact. Small limits keep it safe on a
shared machine; the bound scales: the calls of a pool never hold more than ``pool_memory_bytes``.

Usage: python experiments/benchmarks/bench_sandbox_memory.py [--workers 2] [--slots 4]
       [--memory-mib 512] [--pool-memory-mib 1024] [--hold-s 3] [--trainer-mib 256]
"""
from __future__ import annotations

import argparse
import collections
import os
import threading
import time

import numpy as np

from rstar2_jax.sandbox import SandboxPool

FILL = """import os, time
for _ in range(2):
    if os.fork() == 0:
        break
blocks = []
try:
    while True:
        blocks.append(b'x' * (16 << 20))
except MemoryError:
    pass
time.sleep({hold_s})
print(len(blocks))
"""


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable:"))


def template_group_peaks(template_pids: list[int]) -> int | None:
    """Sum of the template memory groups' peak usage (cgroup v1), or None elsewhere."""
    total = 0
    for pid in template_pids:
        with open(f"/proc/{pid}/cgroup") as f:
            own = next((line.rstrip("\n").split(":", 2)[2] for line in f if ":memory:" in line), None)
        path = f"/sys/fs/cgroup/memory{own}/rstar2-sandbox-{pid}/memory.max_usage_in_bytes"
        if own is None or not os.path.exists(path):
            return None
        with open(path) as f:
            total += int(f.read())
    return total


def run(workers: int, slots: int, memory_bytes: int, pool_bytes: int, hold_s: float, trainer: np.ndarray) -> None:
    with SandboxPool(num_workers=workers, slots_per_worker=slots, timeout_s=hold_s + 60,
                     memory_bytes=memory_bytes, pool_memory_bytes=pool_bytes) as pool:
        before = mem_available()
        lowest, done = [before], threading.Event()

        def sample():
            while not done.is_set():
                lowest[0] = min(lowest[0], mem_available())
                time.sleep(0.02)

        sampler = threading.Thread(target=sample)
        sampler.start()
        results = pool.run_batch([FILL.format(hold_s=hold_s)] * (workers * slots))
        done.set()
        sampler.join()
        peak = template_group_peaks(pool.health()["template_pids"])
    statuses = collections.Counter(r.status for r in results)
    mib = 1 << 20
    print(f"pool bound {pool_bytes / mib:.0f} MiB ({workers} templates x {slots} slots, {memory_bytes / mib:.0f} MiB "
          f"per call, {workers * slots * memory_bytes / mib:.0f} MiB asked): statuses {dict(statuses)}, "
          f"calls' peak together {'n/a' if peak is None else f'{peak / mib:.0f} MiB'}, "
          f"MemAvailable drop {(before - lowest[0]) / mib:.0f} MiB, trainer's {trainer.nbytes / mib:.0f} MiB intact: "
          f"{bool((trainer == 1).all())}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--memory-mib", type=int, default=512)
    parser.add_argument("--pool-memory-mib", type=int, default=1024)
    parser.add_argument("--hold-s", type=float, default=3.0)
    parser.add_argument("--trainer-mib", type=int, default=256)
    args = parser.parse_args()
    mib = 1 << 20
    trainer = np.ones(args.trainer_mib * mib, dtype=np.uint8)
    print(f"MemTotal-based default bound on this host: half of it; oom_score_adj of this process "
          f"{open('/proc/self/oom_score_adj').read().strip()}, of a call 1000")
    for bound in (args.pool_memory_mib * mib, args.workers * args.slots * args.memory_mib * mib):
        run(args.workers, args.slots, args.memory_mib * mib, bound, args.hold_s, trainer)


if __name__ == "__main__":
    main()
