"""Builds the toy data directory (problems, SFT demonstrations, tokenizer) and prints its figures.

    python experiments/toy/build_data.py --out runs/toy_data [--n-sft 1000 ...]

The main job builds the same directory itself; this script is for inspecting the data.
"""
import argparse
import collections
import os
import statistics
import time

from transformers import AutoTokenizer

from rstar2_jax import chat
from rstar2_jax.sandbox import SandboxPool
from rstar2_jax.toy import TOY_FORMAT, sft_data
from rstar2_jax.toy.build import ToyDataConfig, build_toy_data


def main() -> None:
    defaults = ToyDataConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--n-train", type=int, default=defaults.n_train)
    parser.add_argument("--n-test", type=int, default=defaults.n_test)
    parser.add_argument("--n-sft", type=int, default=defaults.n_sft)
    parser.add_argument("--vocab-size", type=int, default=defaults.vocab_size)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    args = parser.parse_args()
    config = ToyDataConfig(n_train=args.n_train, n_test=args.n_test, n_sft=args.n_sft,
                           vocab_size=args.vocab_size, seed=args.seed)
    start = time.perf_counter()
    with SandboxPool() as pool:
        build_toy_data(args.out, config, pool)
    print(f"built {args.out} in {time.perf_counter() - start:.1f} s")

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(args.out, "tokenizer"))
    lengths = collections.defaultdict(list)
    for demo in sft_data.load_demos(os.path.join(args.out, "sft.jsonl")):
        ids, _ = chat.encode_conversation(tokenizer, demo.messages, TOY_FORMAT)
        lengths[demo.style].append(len(ids))
    print(f"vocabulary: {len(tokenizer)} tokens")
    print(f"{'style':<12} {'demos':>6} {'tokens mean':>12} {'max':>5}")
    for style in sft_data.STYLES:
        n = lengths[style]
        if n:
            print(f"{style:<12} {len(n):>6} {statistics.mean(n):>12.1f} {max(n):>5}")


if __name__ == "__main__":
    main()
