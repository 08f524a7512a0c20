"""The sampler's host loop between decode chunks, with the device's work taken out: what
`Engine.decode` costs the host per call (scheduling rows and pages, block tables, dispatch, the
one synchronisation that fetches the chunk's tokens, the rows' bookkeeping).

    python experiments/benchmarks/bench_host_loop.py --slots 64 --chunk 64 --calls 40
    python experiments/benchmarks/bench_host_loop.py --slots 64 --chunk 64 --min-stops 1 --stop-every 16

The policy is a stand-in with the cached forward's signature that writes nothing and returns
fixed logits over a 16-token vocabulary, so a call's device time is a few microseconds and what
is left is the host's. Every row decodes until ``--stop-every`` tokens have passed since its
start (then stops, as at a tool call, and is resumed with 8 tool tokens) or its budget ends.
Reported per `decode` call: wall time, and the top functions of a cProfile run.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from rstar2_jax.model import ModelConfig
from rstar2_jax.sampler.engine import Engine
from rstar2_jax.sampler.sampling import SamplingParams

VOCAB = 16
CONFIG = ModelConfig(model_type="qwen3", vocab_size=VOCAB, hidden_size=8, intermediate_size=8,
                     num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8,
                     max_position_embeddings=1 << 16)


def stand_in(params, config, tokens, cache, num_new=None, *, last_only=False):
    """Logits favouring token 1 (never the stop token 0), the cache as it was but for lengths."""
    batch = tokens.shape[0]
    num_new = jnp.ones((batch,), jnp.int32) if num_new is None else num_new
    logits = jnp.zeros((batch, VOCAB), jnp.float32).at[:, 1].set(5.0)
    return (logits if last_only else logits[:, None]), cache.replace(lengths=cache.lengths + num_new)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--min-stops", type=int, help="return after this many rows stop")
    parser.add_argument("--stop-every", type=int, default=0,
                        help="rows stop (a tool call) after this many tokens; 0: never")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    args = parser.parse_args()

    engine = Engine({"w": jnp.zeros(())}, CONFIG, num_slots=args.slots, max_len=1 << 15,
                    max_prompt_len=args.prompt_tokens, sampling=SamplingParams(temperature=0.0),
                    stop_tokens=(0,), chunk=args.chunk, page_size=32, forward_fn=stand_in,
                    num_pages=args.slots * 1024 + 64)
    prompt = list(range(1, args.prompt_tokens + 1))
    staged = engine.stage_prompts([prompt])[0]
    keys = np.zeros((2,), np.uint32)
    budget = args.stop_every or (1 << 14)
    engine.admit([(staged, row, budget, keys) for row in range(args.slots)])
    engine.unstage(staged)

    def step():
        out = engine.decode(min_stops=args.min_stops)
        stopped = np.flatnonzero(out.stopped)
        if len(stopped):  # a tool call: 8 tokens appended, the row goes on
            engine.resume({int(r): ([int(engine.pending[r])] + [2] * 7, 3, budget)
                           for r in stopped})
        return out

    step()  # compilation
    times, tokens = [], 0
    profile = cProfile.Profile()
    for _ in range(args.calls):
        start = time.perf_counter()
        profile.enable()
        out = step()
        profile.disable()
        times.append(time.perf_counter() - start)
        tokens += int(out.count.sum())
    print(f"{jax.devices()[0].device_kind}: {args.slots} slots, chunk {args.chunk}, min_stops "
          f"{args.min_stops}, rows stop every {args.stop_every or 'never'} tokens: "
          f"{statistics.median(times) * 1e3:.1f} ms per decode call (median of {args.calls}), "
          f"{tokens / args.calls:.0f} tokens per call, {sum(times) / tokens * 1e6:.1f} us of host "
          "time per token")
    pstats.Stats(profile).sort_stats("cumulative").print_stats(14)


if __name__ == "__main__":
    main()
