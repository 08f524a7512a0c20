"""Decode throughput: our sampler next to transformers `generate`, same weights, same run.

    python experiments/benchmarks/bench_decode.py [--new-tokens 128] [--repeats 3]

The model is the ~30M-parameter Qwen3 config of the issues (hidden 512, intermediate 2048,
8 layers, 8 heads, 4 KV heads, head_dim 64, vocab 4096, tied embeddings) with random weights,
written as a Hugging Face checkpoint and loaded by both sides. Both decode greedily for a fixed
number of new tokens (no early stop) from 32-token prompts; compile / warm-up runs are excluded
and the median of the repeats is reported. Each measurement runs in its own process, so that
neither library's thread pools slow the other down.

The last two columns bound what any float32 decoder can reach here: the tokens/s if a decode
step cost nothing but its weight matmuls ([batch, 512] times every layer's q, k, v, o, gate,
up, down and the vocab head), timed as one jitted loop of exactly those matmuls, with no
attention, norms, cache writes or sampling.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

CONFIG = dict(vocab_size=4096, hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
              num_attention_heads=8, num_key_value_heads=4, head_dim=64,
              tie_word_embeddings=True, max_position_embeddings=4096)


def write_checkpoint(path: str) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.Qwen3Config(**CONFIG), dtype=torch.float32)
    model.save_pretrained(path)


def time_ours(path, prompts, new_tokens, repeats):
    from rstar2_jax.model import load_hf
    from rstar2_jax.sampler import generate

    config, params = load_hf(path)
    generate(params, config, prompts, new_tokens)  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = generate(params, config, prompts, new_tokens)
        times.append(time.perf_counter() - start)
        assert all(len(g.tokens) == new_tokens for g in out)
    return statistics.median(times)


def time_transformers(path, prompts, new_tokens, repeats):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    ids = torch.as_tensor(np.asarray(prompts, np.int64))
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        model.generate(ids, **kwargs)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            out = model.generate(ids, **kwargs)
            times.append(time.perf_counter() - start)
            assert out.shape[1] == ids.shape[1] + new_tokens
    return statistics.median(times)


def time_matmul_floor(path, prompts, new_tokens, repeats):
    """Seconds for `new_tokens` steps of a decode step's matmuls alone (see the module doc)."""
    import jax
    import jax.numpy as jnp

    from rstar2_jax.model import load_hf

    config, params = load_hf(path)
    layers = params["layers"]
    # One array per layer and matrix: slicing a stacked array inside the loop would copy it.
    names = ("q", "k", "v", "o", "gate", "up", "down")
    shapes = {"q": (config.hidden_size, -1), "k": (config.hidden_size, -1),
              "v": (config.hidden_size, -1), "o": (-1, config.hidden_size)}
    weights = [{n: layers[n][i].reshape(shapes.get(n, layers[n][i].shape)) for n in names}
               for i in range(config.num_layers)]
    head = params["embed"].T
    x = jnp.ones((len(prompts), config.hidden_size), jnp.float32)

    @jax.jit
    def steps(x, weights, head):
        def step(_, x):
            for w in weights:
                attn = jnp.concatenate([x @ w["q"], x @ w["k"], x @ w["v"]], axis=1)
                x = x + attn[:, : w["q"].shape[1]] @ w["o"]
                x = x + ((x @ w["gate"]) * (x @ w["up"])) @ w["down"]
            return x + (x @ head)[:, : x.shape[1]] * 1e-6
        return jax.lax.fori_loop(0, new_tokens, step, x)

    args = (x, weights, head)
    jax.block_until_ready(steps(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(steps(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(side: str, path: str, batch: int, args) -> float:
    """Seconds per call of `side` ("ours" | "transformers" | "floor"), in a fresh process."""
    out = subprocess.run(
        [sys.executable, __file__, "--side", side, "--path", path, "--batches", str(batch),
         "--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens),
         "--repeats", str(args.repeats)],
        check=True, capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--side", choices=["ours", "transformers", "floor"], help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:  # a child: one measurement, printed on the last line
        batch = args.batches[0]
        prompts = np.random.default_rng(0).integers(
            1, CONFIG["vocab_size"], (batch, args.prompt_tokens)).tolist()
        timer = {"ours": time_ours, "transformers": time_transformers,
                 "floor": time_matmul_floor}[args.side]
        print(timer(args.path, prompts, args.new_tokens, args.repeats))
        return
    with tempfile.TemporaryDirectory() as path:
        write_checkpoint(path)
        print(f"{'batch':>5} {'ours tok/s':>11} {'transformers tok/s':>19} {'ratio':>6} "
              f"{'matmul-only tok/s':>18} {'its ratio':>9}")
        for batch in args.batches:
            ours = measure("ours", path, batch, args)
            theirs = measure("transformers", path, batch, args)
            floor = measure("floor", path, batch, args)
            tokens = batch * args.new_tokens
            print(f"{batch:>5} {tokens / ours:>11.0f} {tokens / theirs:>19.0f} "
                  f"{theirs / ours:>6.2f} {tokens / floor:>18.0f} {theirs / floor:>9.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
