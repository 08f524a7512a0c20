"""The RL rollout phase: tokens/s, the memory roofline, and plain generate() at the same shape.

    python -m rstar2_jax demo                       # once: writes runs/demo/sft_model
    python experiments/benchmarks/bench_rollout.py [--policy runs/demo/sft_model] [--slots 16 64]

Runs agentic rollouts (`AgentSampler.rollout`: turns, real Python tool calls in the sandbox,
resumes) of a policy on the toy task's held-out problems, at each slot count, and prints:

- rollout tokens/s (model tokens only), tool calls, the mean tool latency, the fraction of the
  rollout's wall time in which no row could decode because every live row waited on a tool, and
  the rows preempted for lack of KV cache pages;
- the same rollout again with every tool call answered at once from the first run's results
  ("replayed": same tokens, no sandbox). On a machine with few cores the sandbox's processes
  compete with XLA for them; on an accelerator host they run beside the device. The replayed
  figure is what the engine and the agentic loop cost;
- roofline: the fraction of the memory-bandwidth bound reached. A decode step must at least read
  the serving params once and each running row's keys and values, so the rollout cannot take
  less than ``(decode steps x param bytes + sum over generated tokens of their context x KV
  bytes per token) / bandwidth``, the bandwidth being a measured in-place update (read + write
  of a 512 MiB array; on an accelerator, close to its HBM bandwidth);
- plain `generate()` at the same shape: the same prompts and samples, each row generating as
  many tokens as its trajectory's response (tool tokens included), no stop tokens, same slots,
  chunk and temperature. `ratio` is generate's wall time over the rollout's (sandbox, replayed):
  the rollout's throughput over the same sequences as a fraction of decoding them alone (the
  rollout prefills tool tokens that generate decodes one by one).

Any Hugging Face checkpoint with its tokenizer can be the policy (`--policy`: e.g. a Qwen3-0.6B
directory on an accelerator, with `--serving-dtype bfloat16`); prompts use the toy task's chat
format. ``--model qwen3-0.6b`` serves random weights of that shape instead, with a small toy
tokenizer and synthetic questions (no checkpoint or data needed): every row then decodes to
``--max-response-tokens`` (a random policy almost never stops or calls the tool), which is the
decode throughput of the agentic loop at that shape.

``--concurrent-update ROWS TOKENS`` also times the sandboxed rollout while RL train steps of
[ROWS, TOKENS] (float32 master weights, the accelerators' compute policy) run on the same device
in another thread, as an asynchronous run on one device does (`rl.max_staleness` > 0 without
rollout devices): rollout tokens/s alone and beside the update, and the update's step time alone
and beside the rollout. The serving copy (`roles.ServingCopy`: the master weights cast to the
serving dtype, each step of an RL run) is timed too.

Compilation is excluded (``--warmups`` untimed runs per setting, with other seeds); medians over
repeats.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import statistics
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from bench_train_step import MODELS, OPTIMIZER, random_batch, rl_step

from rstar2_jax import chat
from rstar2_jax.model.params import init_params
from rstar2_jax.parallel.roles import ServingCopy
from rstar2_jax.parallel.sharding import make_mesh
from rstar2_jax.toy.tokenizer import build_tokenizer
from rstar2_jax.train.configs import PrecisionConfig, RLConfig
from rstar2_jax.train.step import TrainState


def copy_bandwidth() -> float:
    """Bytes/s read and written by a jitted in-place update of a 512 MiB float32 array on the
    default device (median).

    The array is donated, so the update writes into its own buffer: a copy into a fresh output
    measures the allocator instead (on CPU, faulting in 512 MiB of new pages each call ran at
    5.5-7.3 GB/s where the in-place update runs at ~48 GB/s on the same machine).
    """
    x = jnp.ones((1 << 27,), jnp.float32)
    scale = jax.jit(lambda x: x * 1.0001, donate_argnums=0)
    x = jax.block_until_ready(scale(x))
    times = []
    for _ in range(5):
        start = time.perf_counter()
        x = jax.block_until_ready(scale(x))
        times.append(time.perf_counter() - start)
    return 2 * x.nbytes / statistics.median(times)


def roofline_s(trajs, stats, param_bytes: int, kv_per_token: int, bandwidth: float) -> float:
    """Seconds the rollout's decode steps take at least, moving only what they must."""
    reads = sum(len(t.prompt_ids) + i for t in trajs for i, m in enumerate(t.loss_mask) if m)
    return (stats.decode_steps * param_bytes + reads * kv_per_token) / bandwidth


def random_policy(name: str, questions: int):
    """(config, float32 params, tokenizer, prompts texts) of random weights at a named shape, with
    a toy tokenizer trained on synthetic questions (the model's vocabulary stays the shape's)."""
    rng = np.random.default_rng(0)
    texts = [f"What is {rng.integers(10**6, 10**9)} * {rng.integers(10**6, 10**9)} modulo "
             f"{rng.integers(3, 1000)}? Use python to compute it." for _ in range(questions)]
    tokenizer = build_tokenizer(texts * 4, vocab_size=512)
    config = dataclasses.replace(MODELS[name], dtype="float32")  # master weights, as a run's
    return config, init_params(config, jax.random.key(0)), tokenizer, texts


def serving_copy_ms(config, params, dtype: str, repeats: int = 5) -> float:
    """Median milliseconds of the RL loop's serving copy on one device (the cast to ``dtype``)."""
    copy = ServingCopy(config, make_mesh(devices=jax.devices()[:1]), None, jnp.dtype(dtype))
    copy(params)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        copy(params)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


class Updater:
    """RL train steps of random [rows, tokens] batches on the default device, in a thread.

    ``alone(n)`` times n steps with nothing beside them; ``start()`` / ``stop()`` run steps
    back to back until stopped and return the step times of that window.
    """

    def __init__(self, config, params, rows: int, tokens: int):
        self._step = rl_step(config, PrecisionConfig(), RLConfig(remat=True))
        params = jax.tree.map(jnp.copy, params)  # the step donates its state
        self._state = TrainState(params, OPTIMIZER.init(params), jnp.zeros((), jnp.int32))
        self._batch = random_batch(config, rows, tokens)
        self._stop, self._thread, self._times = threading.Event(), None, []

    def _one(self) -> float:
        start = time.perf_counter()
        self._state, metrics = self._step(self._state, self._batch)
        jax.block_until_ready(metrics)
        return time.perf_counter() - start

    def alone(self, steps: int) -> float:
        """Median seconds of ``steps`` steps after one untimed (compiling) step."""
        self._one()
        return statistics.median(self._one() for _ in range(steps))

    def start(self) -> None:
        self._stop.clear()
        self._times = []

        def loop():
            while not self._stop.is_set():
                self._times.append(self._one())

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def stop(self) -> list[float]:
        self._stop.set()
        self._thread.join()
        return self._times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="runs/demo/sft_model")
    parser.add_argument("--model", choices=sorted(MODELS),
                        help="random weights of this shape instead of --policy (toy tokenizer)")
    parser.add_argument("--concurrent-update", type=int, nargs=2, metavar=("ROWS", "TOKENS"),
                        help="also time the rollout beside RL train steps of [ROWS, TOKENS]")
    parser.add_argument("--problems", default="runs/demo/data/test.jsonl")
    parser.add_argument("--slots", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-response-tokens", type=int, default=320)
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=32)
    parser.add_argument("--page-size", type=int, default=32)
    parser.add_argument("--serving-dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--memory-budget-gib", type=float, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmups", type=int, default=3,
                        help="untimed runs first: each may meet new table and prefill buckets")
    args = parser.parse_args()
    if args.model is None and not Path(args.policy).exists():
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

    if args.model is not None:
        config, params, tokenizer, questions = random_policy(args.model, args.questions)
    else:
        tokenizer = AutoTokenizer.from_pretrained(args.policy)
        config, params = load_hf(args.policy)
        questions = [p.question for p in load_problems(args.problems)[: args.questions]]
    prompts = [chat.encode_prompt(tokenizer, q, TOY_FORMAT) for q in questions]
    bandwidth = copy_bandwidth()
    print(f"device {jax.devices()[0].device_kind}; measured copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    serving = RolloutSettings(serving_dtype=args.serving_dtype).serving_config(config).dtype
    print(f"serving copy of {config.dtype} params as {serving}: "
          f"{serving_copy_ms(config, params, serving):.1f} ms")
    updater = None
    if args.concurrent_update:
        updater = Updater(config, params, *args.concurrent_update)
        update_alone = updater.alone(args.repeats)
        print(f"update step [{args.concurrent_update[0]}, {args.concurrent_update[1]}] alone: "
              f"{update_alone:.3f} s")

    class TimedPool:
        """Records each call's latency (submit to result) and result."""

        def __init__(self, pool):
            self.pool, self.latencies, self.results = pool, [], {}

        def submit(self, code, stdin=""):
            start = time.perf_counter()
            future = self.pool.submit(code, stdin)

            def done(f):
                self.latencies.append(time.perf_counter() - start)
                self.results[code, stdin] = f.result()

            future.add_done_callback(done)
            return future

    class Replay:
        """Answers each call at once with the result a TimedPool recorded."""

        def __init__(self, timed):
            self.timed = timed

        def submit(self, code, stdin=""):
            if (code, stdin) not in self.timed.results:  # a call the first run did not make
                return self.timed.pool.submit(code, stdin)
            future = concurrent.futures.Future()
            future.set_result(self.timed.results[code, stdin])
            return future

    def same_shape_generate(sampler, trajs, slots: int, seed: int) -> tuple[float, float]:
        """(seconds, tokens/s) of generate() with each row as long as its trajectory's
        response."""
        start = time.perf_counter()
        out = generate(sampler._engine.params, sampler._engine.config,
                       [t.prompt_ids for t in trajs], [len(t.response_ids) for t in trajs],
                       temperature=1.0, seed=seed, num_slots=slots, chunk=args.chunk,
                       page_size=args.page_size)
        wall = time.perf_counter() - start
        return wall, sum(len(g.tokens) for g in out) / wall

    print(f"{'slots':>5} {'rows':>5} {'tok/s':>7} {'roofline':>9} {'calls':>6} {'tool ms':>8} "
          f"{'tool wait':>10} {'preempt':>8} {'replayed tok/s':>15} {'generate tok/s':>15} "
          f"{'ratio':>12}")
    with SandboxPool(timeout_s=4.0) as pool:
        for slots in args.slots:
            timed = TimedPool(pool)
            settings = RolloutSettings(
                show_tool_time=False, num_slots=slots, chunk=args.chunk,
                page_size=args.page_size, serving_dtype=args.serving_dtype,
                memory_budget_gib=args.memory_budget_gib)
            limits = RolloutLimits(max_turns=args.max_turns,
                                   max_response_tokens=args.max_response_tokens,
                                   max_prompt_tokens=max(map(len, prompts)))
            sampler, replayed = (
                AgentSampler(config, tokenizer, executor, settings, limits,
                             SamplingParams(temperature=1.0))
                for executor in (timed, Replay(timed)))
            runs = []
            for seed in range(-args.warmups, args.repeats):  # negative seeds: compile, untimed
                timed.latencies.clear()
                trajs, stats = sampler.rollout(params, prompts, args.samples, seed=seed + 1000)
                _, again = replayed.rollout(params, prompts, args.samples, seed=seed + 1000)
                plan = sampler.plan
                roof = roofline_s(trajs, stats, plan.params, plan.kv_per_token, bandwidth)
                wall, plain = same_shape_generate(sampler, trajs, slots, seed + 1000)
                if seed >= 0:
                    runs.append((stats.tokens_per_s, roof / stats.wall_s, stats.tool_calls,
                                 1000 * statistics.mean(timed.latencies or [0.0]),
                                 stats.tool_wait_fraction, stats.preemptions, again.tokens_per_s,
                                 plain, wall / stats.wall_s, wall / again.wall_s))
            tok, roof, calls, ms, wait, preempt, replay, plain, ratio, ratio_replayed = (
                statistics.median(x) for x in zip(*runs))
            print(f"{slots:>5} {settings.rows:>5} {tok:>7.0f} {100 * roof:>8.1f}% {calls:>6.0f} "
                  f"{ms:>8.1f} {100 * wait:>9.1f}% {preempt:>8.0f} {replay:>15.0f} "
                  f"{plain:>15.0f} {ratio:>5.2f}, {ratio_replayed:>4.2f}", flush=True)
            if updater is not None:
                beside, steps = [], []
                for seed in range(args.repeats):
                    updater.start()
                    _, stats = sampler.rollout(params, prompts, args.samples, seed=seed + 1000)
                    window = updater.stop()
                    steps += window
                    beside.append(stats.tokens_per_s)
                    print(f"      beside the update, seed {seed}: {stats.tokens_per_s:.0f} tok/s, "
                          f"{len(window)} update steps in {stats.wall_s:.1f} s", flush=True)
                alongside = statistics.median(beside)
                print(f"      beside the update: rollout {alongside:.0f} tok/s ({alongside / tok:.2f}x "
                      f"alone); update step {statistics.median(steps):.3f} s ({len(steps)} steps, "
                      f"{statistics.median(steps) / update_alone:.2f}x alone)", flush=True)


if __name__ == "__main__":
    main()
