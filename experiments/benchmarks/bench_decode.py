"""Greedy decode: tokens/s against the memory roofline, and XLA's bytes per step against the least.

    python experiments/benchmarks/bench_decode.py --batches 64 --repeats 3     # CPU: 30M Qwen3 vs transformers
    python experiments/benchmarks/bench_decode.py --model qwen3-0.6b --dtype bfloat16 \\
        --batches 1 64 256 --prompt-tokens 128 --new-tokens 256               # an accelerator
    python experiments/benchmarks/bench_decode.py --model qwen3-0.6b --dtype bfloat16 \\
        --batches 64 --prompt-tokens 128 --new-tokens 128 --cost-only          # any machine, no weights
    python experiments/benchmarks/bench_decode.py --compile-depths 4 28        # first call vs depth
    python experiments/benchmarks/bench_decode.py --batches 64 --split         # a step's parts
    python experiments/benchmarks/bench_decode.py --model qwen3-0.6b --dtype bfloat16 \\
        --batches 1 64 --unroll-layers                      # layers unrolled (GPU command buffers)

Decoding: `rstar2_jax.sampler.generate` of random prompts of ``--prompt-tokens`` tokens, greedy,
exactly ``--new-tokens`` new tokens per row (no stop token), random weights of the ``--model``
shape in ``--dtype``; the first call (compilation) is excluded, the median of ``--repeats``
calls is reported. Each measurement runs in its own process, so that neither library's thread
pools slow the other down; with ``--rounds N`` each side runs in N processes, the sides
alternating, and the medians are reported (on a shared machine, so that a change of load hits
every side alike). Columns:

- ``ours``: tokens/s (batch x new tokens / seconds of the call, prefill included), and the
  ``first call`` (compilation and one call);
- ``transformers`` (on CPU, or with ``--transformers``): its `generate` on the same weights
  (written as a Hugging Face checkpoint), float32 or bfloat16 as ``--dtype``, and ours / its;
- ``roofline``: the fraction of the memory-bandwidth bound reached. A decode step must read the
  params once and each row's keys and values once, so the call cannot take less than
  ``sum over its steps of (param bytes + batch x context x KV bytes per token) / bandwidth``;
  the bandwidth is the device's HBM bandwidth (a datasheet table, by `device_kind`) on an
  accelerator and a measured in-place update (read + write of 512 MiB) elsewhere;
- on CPU, ``matmul-only``: the tokens/s of a loop doing nothing but a decode step's weight
  matmuls ([batch, hidden] times every layer's q, k, v, o, gate, up, down and the vocab head,
  one array per layer and matrix): no attention, norms, cache or sampling. On a CPU, decoding at
  batch 64 is bound by matmul speed, not memory; ``of it`` is ours / this bound.

XLA's cost analysis of one decode step (before the decoding, or alone with ``--cost-only``: the
params and the cache are abstract, nothing is allocated, so it works for any shape on any
machine) at the last step's context (prompt + new tokens), against the least a step must move:
every param once and each row's live keys and values once. The analysed program gathers each
row's pages for the attention, as accelerators do without cuDNN's paged kernel (on CPU a decode
step attends page by page instead, on an NVIDIA GPU by that kernel, which XLA's count cannot
see into; see `rstar2_jax.model.cache`), compiled by the local backend. XLA counts a
loop's body once, so the step is compiled with its layer loop unrolled at 1 and 2 layers and
extrapolated to the model's depth (exact: the layers are identical). XLA also counts a scatter
as reading and writing its whole operand, even in place: the two scatters per layer that write
the new token's key and value into the page pools are then counted as moving both pools, which
they do not (the pools are updated in place: `tests/test_model_cache.py`); the figure is given
as XLA counts it and with those scatters at the bytes they write.

``--split`` (CPU): where a decode step's time goes, in one process: one step at the run's mean
context (`forward_cached` on a paged cache, 16 steps per call), whole, with its attention
replaced by the identity, with its cache writes replaced too, and with the attention replaced
by its page gathers alone (every page it reads, summed); medians of 6 alternating calls.

``--compile-depths 4 28``: the first `generate()` call (compilation included) of a tiny Qwen3
(``--model qwen3-tiny``: hidden 256) at each depth, each in a fresh process, and their ratio.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import hlo_bytes
from bench_rollout import copy_bandwidth
from bench_train_step import MODELS as TRAIN_MODELS

from rstar2_jax.model import ModelConfig

MODELS = TRAIN_MODELS | {
    "qwen3-tiny": ModelConfig(model_type="qwen3", vocab_size=4096, hidden_size=256,
                              intermediate_size=768, num_layers=4, num_heads=4, num_kv_heads=2,
                              head_dim=64, qk_norm=True, tie_embeddings=True,
                              max_position_embeddings=4096),
}

# HBM bandwidth per chip from the vendors' datasheets, by a substring of jax's device_kind
# (more specific names first).
BANDWIDTHS = {
    "H100 PCIe": 2.0e12,
    "H100": 3.35e12,  # SXM
    "H200": 4.8e12,
    "A100": 2.04e12,  # 80 GB SXM
    "MI300X": 5.3e12,
    "MI250X": 3.2e12,
    "TPU v4": 1.2e12,
    "TPU v5 lite": 0.82e12,  # v5e
    "TPU v5": 2.77e12,  # v5p
    "TPU v6 lite": 1.64e12,  # v6e
}


def model_config(args) -> ModelConfig:
    config = dataclasses.replace(MODELS[args.model], dtype=args.dtype)
    return dataclasses.replace(config, num_layers=args.layers) if args.layers else config


def param_bytes(config: ModelConfig) -> int:
    """Bytes a decode step must read: every param once (the embedding table is read whole only
    as the tied output head; the rows a step embeds are negligible)."""
    import jax

    from rstar2_jax.model import param_shapes

    shapes = jax.tree.leaves(param_shapes(config), is_leaf=lambda x: isinstance(x, tuple))
    total = sum(int(np.prod(s)) for s in shapes)
    if not config.tie_embeddings:
        total -= config.vocab_size * config.hidden_size
    return total * np.dtype(config.jnp_dtype).itemsize


def kv_bytes_per_token(config: ModelConfig) -> int:
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * np.dtype(config.jnp_dtype).itemsize


def bandwidth() -> tuple[float, str]:
    """Bytes/s of the default device: its datasheet HBM bandwidth, else a measured in-place update."""
    import jax

    kind = jax.devices()[0].device_kind
    for name, value in BANDWIDTHS.items():
        if name in kind and jax.default_backend() != "cpu":
            return value, f"{name} datasheet"
    return copy_bandwidth(), "measured in-place update"


@contextlib.contextmanager
def _gathered_decode():
    """The gathered decode program while a step is traced (see the module docstring)."""
    from rstar2_jax.model import cache

    in_pages, kernel = cache.decode_in_pages, cache.paged_decode_kernel
    cache.decode_in_pages = lambda: False
    cache.paged_decode_kernel = lambda *_: None
    try:
        yield
    finally:
        cache.decode_in_pages, cache.paged_decode_kernel = in_pages, kernel


def decode_step_cost(config: ModelConfig, batch: int, context: int, page_size: int = 32) -> dict:
    """One greedy decode step of `batch` rows that hold `context - 1` tokens (`context` after
    it), compiled for the local backend with abstract inputs: the bytes it moves (`hlo_bytes`),
    XLA's own count, and the least a step must move; its largest instructions."""
    import jax
    import jax.numpy as jnp

    from rstar2_jax.model import KVCache, forward_cached, init_params
    from rstar2_jax.model.cache import as_bits, empty_pages

    pages = -(-context // page_size)
    spec = jax.ShapeDtypeStruct
    params = jax.eval_shape(functools.partial(init_params, config), jax.random.key(0))
    pools = jax.eval_shape(lambda: tuple(  # kept as the sampler keeps them
        as_bits(pool) for pool in empty_pages(config, batch * pages, page_size)))

    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(params, pools, tokens, table, lengths):
        cache = KVCache.of_pools(pools, table, lengths, config.jnp_dtype)
        logits, cache = forward_cached(params, config, tokens, cache, last_only=True)
        return jnp.argmax(logits, axis=-1), cache.pools

    with _gathered_decode():
        compiled = step.lower(params, pools, spec((batch, 1), jnp.int32),
                              spec((batch, pages), jnp.int32), spec((batch,), jnp.int32)).compile()
    moved, parts = hlo_bytes.bytes_moved(compiled.as_text())
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
    return {"moved": moved, "xla": analysis["bytes accessed"], "parts": parts,
            "least": param_bytes(config) + batch * context * kv_bytes_per_token(config)}


def random_prompts(config: ModelConfig, batch: int, tokens: int) -> list[list[int]]:
    return np.random.default_rng(0).integers(1, config.vocab_size, (batch, tokens)).tolist()


def time_ours(args, config, batch):
    import jax

    from rstar2_jax.model import init_params
    from rstar2_jax.sampler import generate

    params = init_params(config, jax.random.key(0))
    prompts = random_prompts(config, batch, args.prompt_tokens)
    start = time.perf_counter()
    generate(params, config, prompts, args.new_tokens)
    first = time.perf_counter() - start
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        out = generate(params, config, prompts, args.new_tokens)
        times.append(time.perf_counter() - start)
        assert all(len(g.tokens) == args.new_tokens for g in out)
    return {"seconds": statistics.median(times), "first": first}


def time_transformers(args, config, batch):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(args.path, dtype=getattr(torch, args.dtype))
    model.eval()
    ids = torch.as_tensor(np.asarray(random_prompts(config, batch, args.prompt_tokens), np.int64))
    kwargs = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                  pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        model.generate(ids, **kwargs)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            out = model.generate(ids, **kwargs)
            times.append(time.perf_counter() - start)
            assert out.shape[1] == ids.shape[1] + args.new_tokens
    return {"seconds": statistics.median(times)}


def time_matmul_floor(args, config, batch):
    """Seconds for `new_tokens` steps of a decode step's matmuls alone (see the module doc)."""
    import jax
    import jax.numpy as jnp

    from rstar2_jax.model import init_params

    params = init_params(config, jax.random.key(0))
    layers = params["layers"]
    names = ("q", "k", "v", "o", "gate", "up", "down")
    shapes = {"q": (config.hidden_size, -1), "k": (config.hidden_size, -1),
              "v": (config.hidden_size, -1), "o": (-1, config.hidden_size)}
    # One array per layer and matrix: none is sliced out of a stacked array inside the loop.
    weights = [{n: layers[n][i].reshape(shapes.get(n, layers[n][i].shape)) for n in names}
               for i in range(config.num_layers)]
    head = params["embed"].T
    x = jnp.ones((batch, config.hidden_size), config.jnp_dtype)

    @jax.jit
    def steps(x, weights, head):
        def step(_, x):
            for w in weights:
                attn = jnp.concatenate([x @ w["q"], x @ w["k"], x @ w["v"]], axis=1)
                x = x + attn[:, : w["q"].shape[1]] @ w["o"]
                x = x + ((x @ w["gate"]) * (x @ w["up"])) @ w["down"]
            return x + (x @ head)[:, : x.shape[1]] * 1e-6
        return jax.lax.fori_loop(0, args.new_tokens, step, x)

    jax.block_until_ready(steps(x, weights, head))
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        jax.block_until_ready(steps(x, weights, head))
        times.append(time.perf_counter() - start)
    return {"seconds": statistics.median(times)}


def time_first_call(args, config, batch):
    """The first `generate()` call of a fresh process: compilation and one run."""
    import jax

    from rstar2_jax.model import init_params
    from rstar2_jax.sampler import generate

    params = jax.block_until_ready(init_params(config, jax.random.key(0)))
    start = time.perf_counter()
    generate(params, config, random_prompts(config, batch, args.prompt_tokens), args.new_tokens)
    return {"seconds": time.perf_counter() - start}


def time_split(args, config, batch: int, rounds: int = 6, steps: int = 16) -> dict:
    """Milliseconds per decode step at the run's mean context: the whole step; the attention
    replaced by the identity; the cache writes too; and the attention replaced by its page
    gathers alone (each page of each row read and summed, no attention math). `forward_cached`
    on a paged cache, `steps` steps per call, the variants alternating over `rounds` calls,
    medians. The parts are swapped while each variant is traced: each is its own program."""
    import jax
    import jax.numpy as jnp

    from rstar2_jax.model import cache as kv
    from rstar2_jax.model import init_params

    page_size = 32
    context = args.prompt_tokens + (args.new_tokens + 1) // 2
    width = -(-(context + steps) // page_size)
    num_pages = batch * width
    params = init_params(config, jax.random.key(0))
    table = jnp.asarray(np.random.default_rng(0).permutation(num_pages).reshape(batch, width),
                        jnp.int32)
    # The pools as the sampler keeps them: 16-bit floats as their bits (`kv.as_bits`).
    bits = kv.as_bits(jnp.zeros((), config.jnp_dtype)).dtype != config.jnp_dtype
    bits_of = config.jnp_dtype if bits else None

    def pools():
        return [kv.as_bits(pool) for pool in kv.empty_pages(config, num_pages, page_size)]

    def gathers_only(q, k_pool, v_pool, layer, table, lengths, *_):
        """q [B, 1, H, D] plus the sum of every page `attend_pages` reads."""
        def page(i, acc):
            k, v = (kv.read_pages(pool, layer, table[:, i, None], bits_of)[:, 0]
                    for pool in (k_pool, v_pool))
            return acc + (k + v).sum(axis=(1, 2))[:, None, None, :]  # [B, 1, 1, D]

        pages = (jnp.max(lengths) + page_size - 1) // page_size
        total = jax.lax.fori_loop(0, pages, page, jnp.zeros((q.shape[0], 1, 1, q.shape[3])))
        return (q + total).astype(q.dtype)

    def keep_attention(q, *_, **__):
        return q

    def keep_pool(cache, pool, *_):
        return pool

    originals = {"attend_pages": kv.attend_pages, "write_tokens": kv.write_tokens}
    swaps = {"whole step": {}, "without attention": {"attend_pages": keep_attention},
             "without attention and cache writes": {"attend_pages": keep_attention,
                                                    "write_tokens": keep_pool},
             "attention's page gathers alone": {"attend_pages": gathers_only}}

    def variant(swap):
        def run(params, k, v, tokens):
            for name, fn in originals.items():  # at trace time
                setattr(kv, name, swap.get(name, fn))

            def step(i, carry):
                k, v, tokens = carry
                cache = kv.KVCache(k=k, v=v, block_table=table, dtype=bits_of,
                                   lengths=jnp.full((batch,), context, jnp.int32) + i)
                logits, cache = kv.forward_cached.__wrapped__(params, config, tokens, cache,
                                                              last_only=True)
                return cache.k, cache.v, jnp.argmax(logits, -1)[:, None].astype(jnp.int32)

            out = jax.lax.fori_loop(0, steps, step, (k, v, tokens))
            for name, fn in originals.items():
                setattr(kv, name, fn)
            return out
        return jax.jit(run, donate_argnums=(1, 2))

    fns = {label: variant(swap) for label, swap in swaps.items()}
    state = {label: jax.block_until_ready(fn(params, *pools(), jnp.zeros((batch, 1), jnp.int32)))
             for label, fn in fns.items()}
    times = {label: [] for label in fns}
    for _ in range(rounds):
        for label, fn in fns.items():
            start = time.perf_counter()
            state[label] = jax.block_until_ready(fn(params, *state[label]))
            times[label].append((time.perf_counter() - start) / steps * 1e3)
    return {"context": context, "ms": {label: statistics.median(t) for label, t in times.items()}}


SIDES = {"ours": time_ours, "transformers": time_transformers, "floor": time_matmul_floor,
         "first": time_first_call, "split": time_split}


def measure(side: str, args, batch: int, layers: int | None = None) -> dict:
    """`side`'s measurement at `batch` rows, in a fresh process."""
    argv = [sys.executable, __file__, "--side", side, "--batches", str(batch),
            "--model", args.model, "--dtype", args.dtype, "--prompt-tokens", str(args.prompt_tokens),
            "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats)]
    if args.path:
        argv += ["--path", args.path]
    if args.gather:
        argv += ["--gather"]
    if args.unroll_layers:
        argv += ["--unroll-layers"]
    if layers or args.layers:
        argv += ["--layers", str(layers or args.layers)]
    out = subprocess.run(argv, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{side} at batch {batch} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def write_checkpoint(config: ModelConfig, path: str) -> None:
    """Random weights of `config`'s shape as a Hugging Face checkpoint (float32)."""
    import torch
    import transformers

    hf = config.to_hf_dict()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(hf.pop("model_type"), **hf), dtype=torch.float32)
    model.save_pretrained(path)


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f} GB" if x >= 1e8 else f"{x / 1e6:.1f} MB"


def print_cost(args, config, batch: int) -> None:
    context = args.prompt_tokens + args.new_tokens
    cost = decode_step_cost(config, batch, context)
    print(f"one decode step, batch {batch}, context {context}: moves {_gb(cost['moved'])}, "
          f"{cost['moved'] / cost['least']:.2f}x the least {_gb(cost['least'])} (params "
          f"{_gb(param_bytes(config))} + keys/values "
          f"{_gb(batch * context * kv_bytes_per_token(config))}); XLA's cost analysis: "
          f"{_gb(cost['xla'])}. Largest instructions:", flush=True)
    for moved, name, source in cost["parts"][:args.show]:
        print(f"    {_gb(moved):>10}  {name} ({source})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen3-30m")
    parser.add_argument("--layers", type=int, help="override the model's depth")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per process")
    parser.add_argument("--rounds", type=int, default=1,
                        help="processes per side, alternating; medians over all")
    parser.add_argument("--transformers", action="store_true",
                        help="compare with transformers off CPU too")
    parser.add_argument("--cost-only", action="store_true", help="only the decode step's bytes")
    parser.add_argument("--show", type=int, default=6, help="largest instructions to list")
    parser.add_argument("--compile-depths", type=int, nargs="+",
                        help="time the first generate() call at these depths instead")
    parser.add_argument("--split", action="store_true",
                        help="time a decode step whole and without its attention instead")
    parser.add_argument("--gather", action="store_true",
                        help="decode with each row's pages gathered, as the analysed program "
                             "does, also where cuDNN's paged attention runs (an NVIDIA GPU): "
                             "the path it replaced")
    parser.add_argument("--unroll-layers", action="store_true",
                        help="compile the layers unrolled instead of under one loop (on a GPU, "
                             "XLA then captures each layer's kernels in one command buffer)")
    parser.add_argument("--json", help="also write the timed rows here")
    parser.add_argument("--side", choices=sorted(SIDES), help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:  # a child: one measurement, printed as JSON on the last line
        from bench_train_step import _unrolled_loops

        with (_gathered_decode() if args.gather else contextlib.nullcontext(),
              _unrolled_loops() if args.unroll_layers else contextlib.nullcontext()):
            print(json.dumps(SIDES[args.side](args, model_config(args), args.batches[0])))
        return

    import jax

    if args.split:
        if jax.default_backend() != "cpu":
            parser.error("--split times the CPU decode path (`attend_pages`); this is "
                         f"{jax.default_backend()}")
        for batch in args.batches:
            split = measure("split", args, batch)
            print(f"decode step, {args.model}, {args.dtype}, batch {batch}, context "
                  f"{split['context']} ({jax.default_backend()}):")
            for label, ms in split["ms"].items():
                print(f"  {label:>36}: {ms:6.1f} ms")
        return

    if args.compile_depths:
        if args.model == parser.get_default("model"):
            args.model = "qwen3-tiny"
        print(f"first generate() call, {args.model}, batch {args.batches[0]}, "
              f"{args.prompt_tokens} + {args.new_tokens} tokens, {jax.default_backend()}:")
        runs = {depth: [] for depth in args.compile_depths}
        for _ in range(args.rounds):
            for depth in args.compile_depths:
                runs[depth].append(measure("first", args, args.batches[0], layers=depth)["seconds"])
        for depth, times in runs.items():
            print(f"  {depth:3d} layers: {statistics.median(times):6.1f} s  "
                  f"({', '.join(f'{t:.1f}' for t in times)})")
        low, high = min(runs), max(runs)
        print(f"  {high} / {low} layers: "
              f"{statistics.median(runs[high]) / statistics.median(runs[low]):.2f}x")
        return

    config = model_config(args)
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}; "
          f"model {args.model}: {config.num_layers} layers, {args.dtype}, params "
          f"{_gb(param_bytes(config))}, keys/values {kv_bytes_per_token(config) / 1024:.0f} KiB "
          f"per token")
    for batch in args.batches:
        print_cost(args, config, batch)
    if args.cost_only:
        return
    on_cpu = jax.default_backend() == "cpu"
    rate, source = bandwidth()
    print(f"bandwidth: {rate / 1e9:.1f} GB/s ({source})")
    compare = on_cpu or args.transformers
    header = f"{'batch':>5} {'ours tok/s':>11} {'first call':>10} {'roofline':>9}"
    if compare:
        header += f" {'transformers tok/s':>19} {'ours/theirs':>11}"
    if on_cpu:
        header += f" {'matmul-only tok/s':>18} {'of it':>6}"
    with tempfile.TemporaryDirectory() as path:
        if compare:
            write_checkpoint(config, path)
            args.path = path
        print(header, flush=True)
        sides = ["ours"] + ["transformers"] * compare + ["floor"] * on_cpu
        rows = []
        for batch in args.batches:
            # Sides alternate over the rounds, so that a change of load hits them alike.
            runs = {side: [] for side in sides}
            for _ in range(args.rounds):
                for side in sides:
                    runs[side].append(measure(side, args, batch))
            seconds = {side: statistics.median(r["seconds"] for r in runs[side]) for side in sides}
            first = statistics.median(r["first"] for r in runs["ours"])
            tokens = batch * args.new_tokens
            contexts = args.prompt_tokens + np.arange(1, args.new_tokens + 1)
            least_s = (args.new_tokens * param_bytes(config)
                       + batch * contexts.sum() * kv_bytes_per_token(config)) / rate
            row = (f"{batch:>5} {tokens / seconds['ours']:>11.0f} {first:>9.1f}s "
                   f"{least_s / seconds['ours']:>9.1%}")
            if compare:
                row += (f" {tokens / seconds['transformers']:>19.0f} "
                        f"{seconds['transformers'] / seconds['ours']:>11.2f}")
            if on_cpu:
                row += (f" {tokens / seconds['floor']:>18.0f} "
                        f"{seconds['floor'] / seconds['ours']:>6.1%}")
            print(row, flush=True)
            rows.append({"batch": batch, "prompt_tokens": args.prompt_tokens,
                         "new_tokens": args.new_tokens, "tokens_per_s": tokens / seconds["ours"],
                         "first_call_s": first, "roofline": least_s / seconds["ours"],
                         "bandwidth": rate, "unroll_layers": args.unroll_layers})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)

if __name__ == "__main__":
    main()
