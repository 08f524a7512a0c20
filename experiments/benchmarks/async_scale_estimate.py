"""Synchronous against asynchronous RL at the paper's scale, estimated on paper.

    python experiments/benchmarks/async_scale_estimate.py [--device mi300x] [--mean-tokens 4096]
        [--update-mfu 0.278] [--decode-efficiency 0.5] [--seed 0]

No accelerator runs here. The estimate combines what this project measured with stated models
of what it has not, and says which is which (docs/scale_plan.md, "Asynchronous RL at the
paper's scale"):

- the update: the RL train step's FLOPs (6 N per trained token, 2 N for the old log-probs,
  attention on top) at ``--update-mfu`` of the devices' peak: 27.8% is what the RL train step
  reached on one H100 (docs/accelerators.md), the only accelerator figure of the update we have;
- the rollouts: 512 questions x 32 rollouts, response lengths drawn from a log-normal whose mean
  is ``--mean-tokens`` and of which ``--clip`` reach the 8K budget (stage 1 late in the paper:
  mean about 4K, clip ratio near 10%), 300 prompt tokens, ``--calls`` tool calls of
  ``--tool-s`` seconds each (the paper's 0.3 s mean latency);
  engines of ``--tp`` devices decode continuous batches of up to ``--slots`` rows; a decode step
  reads the engine's share of the weights and every running row's keys and values, at
  ``--decode-efficiency`` of the HBM roofline (not measured: no accelerator has run our
  decode since the paged cache landed); rows are handed to engines as they free up (the
  load-balanced queue, `rstar2_jax.parallel.hosts.claims`), and the step's rollouts end with its
  slowest engine (simulated row by row);
- the weight copy: a serving copy (bf16) all-gathered within each host and copied device to
  device to the rollout devices, at ``--link-gbs`` GB/s.

Synchronous: every device rolls out, then every device trains (rollout + update + nothing to
copy: the sampler reads the trainer's params). Asynchronous (``rl.max_staleness`` >= 1,
``mesh.rollout_devices``): r devices roll out while 64 - r train, the step is the slower side
plus the copy. Printed: each side's time, the step time, the speedup over synchronous and each
side's idle share, for a range of r.
"""
from __future__ import annotations

import argparse
import heapq
import math
from statistics import NormalDist

import numpy as np

# Peak dense bf16 FLOP/s and HBM bytes/s per device.
DEVICES = {"mi300x": (1307e12, 5.3e12), "h100": (989e12, 3.35e12), "h200": (989e12, 4.8e12)}
# Qwen3-14B: parameters, layers, hidden size, KV bytes per token (40 layers x 8 kv heads x 128
# dims x K and V x 2 bytes).
PARAMS, LAYERS, HIDDEN = 14.8e9, 40, 5120
KV_BYTES_PER_TOKEN = 40 * 8 * 128 * 2 * 2


def response_lengths(rng, count: int, mean: float, clip: float, budget: int) -> np.ndarray:
    """``count`` response lengths: log-normal with mean ``mean``, the share ``clip`` of it at or
    above ``budget``, cut at ``budget``."""
    # Solve for sigma: P(X >= budget) = clip with E[X] = mean, mu = ln(mean) - sigma^2 / 2.
    z = NormalDist().inv_cdf(1 - clip)
    # ln(budget) = mu + z sigma = ln(mean) - sigma^2/2 + z sigma  ->  sigma^2/2 - z sigma + c = 0
    c = math.log(budget / mean)
    sigma = z - math.sqrt(max(z * z - 2 * c, 0.0))
    mu = math.log(mean) - sigma * sigma / 2
    return np.minimum(rng.lognormal(mu, sigma, count), budget).astype(np.int64)


def rollout_time(lengths: np.ndarray, *, engines: int, tp: int, slots: int, prompt: int,
                 calls: float, tool_s: float, bandwidth: float, efficiency: float,
                 overhead_s: float) -> tuple[float, float]:
    """(seconds until the last of ``lengths`` (in question order) finishes on ``engines``
    engines of ``tp`` devices, the engines' mean busy seconds). An engine keeps up to ``slots`` rows decoding and takes the next
    rollout from the step's queue as soon as a row ends (the load-balanced queue); a decode step
    costs (its share of the bf16 weights + the running rows' keys and values) / (bandwidth x
    efficiency) + ``overhead_s`` (launches, sampling, the host's bookkeeping); a rollout also waits ``calls`` tool calls of ``tool_s`` seconds, which delay it
    and not its engine (other rows decode meanwhile)."""
    weights = 2 * PARAMS / tp
    queue = iter(lengths.tolist())
    rows: list[list[list[int]]] = [[] for _ in range(engines)]  # per engine: [left, context]

    def fill(engine: int) -> None:
        while len(rows[engine]) < slots and (n := next(queue, None)) is not None:
            rows[engine].append([n, prompt])

    events = []
    for engine in range(engines):
        fill(engine)
        heapq.heappush(events, (0.0, engine))
    last, busy = 0.0, 0.0
    while events:  # in time order, so the queue hands out rollouts in the order engines free up
        clock, engine = heapq.heappop(events)
        running = rows[engine]
        ahead = min(left for left, _ in running)  # steps until the next row ends
        context = sum(c for _, c in running) + len(running) * ahead / 2  # mean over the steps
        clock += ahead * ((weights + context * KV_BYTES_PER_TOKEN / tp) / (bandwidth * efficiency)
                          + overhead_s)
        for row in running:
            row[0] -= ahead
            row[1] += ahead
        last = max(last, clock + calls * tool_s)
        rows[engine] = [row for row in running if row[0] > 0]
        fill(engine)
        if rows[engine]:
            heapq.heappush(events, (clock, engine))
        else:
            busy += clock / engines
    return last, busy


def update_time(lengths: np.ndarray, *, devices: int, peak: float, mfu: float, prompt: int) -> float:
    """Seconds of one RL update of these rollouts on ``devices`` devices at ``mfu``."""
    tokens = float(np.sum(lengths + prompt))
    # 6N per trained token, 2N for the old log-probs' forward; causal attention 4 L d per
    # layer per token forward (x 3 with the backward, x 1 more for the old pass).
    attention = float(np.sum((lengths + prompt) ** 2)) * 2 * HIDDEN * LAYERS * 4
    return (8 * PARAMS * tokens + attention) / (devices * peak * mfu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=sorted(DEVICES), default="mi300x")
    parser.add_argument("--devices", type=int, default=64)
    parser.add_argument("--questions", type=int, default=512)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--mean-tokens", type=float, default=4096)
    parser.add_argument("--clip", type=float, default=0.1)
    parser.add_argument("--budget", type=int, default=8192)
    parser.add_argument("--prompt", type=int, default=300)
    parser.add_argument("--calls", type=float, default=2.7, help="tool calls per rollout (45K / 16K)")
    parser.add_argument("--tool-s", type=float, default=0.3)
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--slots", type=int, default=256)
    parser.add_argument("--update-mfu", type=float, default=0.278)
    parser.add_argument("--decode-efficiency", type=float, default=0.5)
    parser.add_argument("--step-overhead-ms", type=float, default=0.0,
                        help="fixed cost of a decode step beyond its memory traffic")
    parser.add_argument("--link-gbs", type=float, default=100.0, help="weight copy GB/s per device")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    peak, bandwidth = DEVICES[args.device]
    rng = np.random.default_rng(args.seed)
    lengths = response_lengths(rng, args.questions * args.samples, args.mean_tokens, args.clip,
                               args.budget)
    decode = dict(tp=args.tp, slots=args.slots, prompt=args.prompt, calls=args.calls,
                  tool_s=args.tool_s, bandwidth=bandwidth, efficiency=args.decode_efficiency,
                  overhead_s=args.step_overhead_ms / 1000)
    # The serving copy: bf16 weights gathered within each host of 8 and sent to its rollout
    # devices; each device moves about the whole copy once.
    copy_s = 2 * PARAMS / (args.link_gbs * 1e9)

    print(f"{args.questions} x {args.samples} rollouts, mean {lengths.mean():.0f} tokens, "
          f"{(lengths >= args.budget).mean():.1%} at the {args.budget}-token budget, "
          f"{lengths.sum() / 1e6:.1f}M response tokens a step; {args.devices} x {args.device}, "
          f"update at {args.update_mfu:.1%} MFU, decode at {args.decode_efficiency:.0%} of the "
          f"HBM roofline + {args.step_overhead_ms:g} ms a step, engines of {args.tp} devices x "
          f"{args.slots} slots")
    rollout_all, busy_all = rollout_time(lengths, engines=args.devices // args.tp, **decode)
    update_all = update_time(lengths, devices=args.devices, peak=peak, mfu=args.update_mfu,
                             prompt=args.prompt)
    sync = rollout_all + update_all
    print("| schedule | rollout devices | rollout s (engines busy) | update s | copy s | step s | "
          "speedup | device time idle |")
    print("|---|---|---|---|---|---|---|---|")
    # Synchronous: engines that finished their rollouts wait for the slowest (the tail).
    print(f"| synchronous | all, then all train | {rollout_all:.0f} ({busy_all:.0f}) | {update_all:.0f} "
          f"| 0 | {sync:.0f} | 1.00x | {(rollout_all - busy_all) / sync:.0%} |")
    for r in range(2 * args.tp, args.devices, 2 * args.tp):
        rollout, busy = rollout_time(lengths, engines=r // args.tp, **decode)
        update = update_time(lengths, devices=args.devices - r, peak=peak, mfu=args.update_mfu,
                             prompt=args.prompt)
        step = max(rollout, update + copy_s)
        idle = (r * (step - busy) + (args.devices - r) * (step - update - copy_s)) / (args.devices * step)
        print(f"| asynchronous, k >= 1 | {r} | {rollout:.0f} ({busy:.0f}) | {update:.0f} | "
              f"{copy_s:.1f} | {step:.0f} | {sync / step:.2f}x | {idle:.0%} |")


if __name__ == "__main__":
    main()
