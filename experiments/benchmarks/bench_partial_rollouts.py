"""Partial rollouts: rollout tokens/s with weight updates landing during the rollout.

    python experiments/benchmarks/bench_partial_rollouts.py [--updates 0 2 4] [--repeats 5]

A tiny random Qwen3 (no checkpoint needed) rolls out questions x samples at temperature 1 with
`AgentSampler` (one turn, no tool calls: a random policy writes none), and new weights arrive
``u`` times per rollout call, at evenly spaced decode calls (the calls a rollout without updates
makes, split into u + 1 equal parts; the weights alternate between two random inits, so every
update changes the policy; `updates` is the number taken: a rollout that ends sooner than the
one without updates takes fewer). ``keep`` continues on the cached prefix; ``recompute``
prefills every row's whole context again per update (the `recomputed rows` column counts
them). Compilation is excluded (``--warmups`` untimed calls per setting); medians over
``--repeats``, the settings taking turns within each repeat.
"""
from __future__ import annotations

import argparse
import statistics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, nargs="+", default=[0, 2, 4])
    parser.add_argument("--modes", nargs="+", default=["keep", "recompute"])
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=16)
    parser.add_argument("--max-response-tokens", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmups", type=int, default=2)
    args = parser.parse_args()

    import jax

    from rstar2_jax.model import ModelConfig, init_params
    from rstar2_jax.sampler import AgentSampler, RolloutLimits, RolloutSettings, SamplingParams
    from rstar2_jax.sampler.weights import WeightUpdates
    from rstar2_jax.toy import TOY_FORMAT
    from rstar2_jax.toy.tokenizer import build_tokenizer

    questions = [f"What is {a} + {b}? " + "Think step by step. " * (a % 5)
                 for a, b in zip(range(args.questions), range(7, 7 + args.questions))]
    tokenizer = build_tokenizer([TOY_FORMAT.prompt_text(q) for q in questions] * 5, vocab_size=300)
    prompts = [tokenizer.encode(TOY_FORMAT.prompt_text(q), add_special_tokens=False)
               for q in questions]
    config = ModelConfig(model_type="qwen3", vocab_size=len(tokenizer), hidden_size=args.hidden,
                         intermediate_size=2 * args.hidden, num_layers=args.layers, num_heads=4,
                         num_kv_heads=2, head_dim=args.hidden // 4, qk_norm=True)
    weights = [init_params(config, jax.random.key(i)) for i in range(2)]

    class Evenly(WeightUpdates):
        """Posts the other init before decode calls ``at`` (1-based)."""

        def __init__(self, at):
            super().__init__()
            self.at, self.calls = set(at), 0

        def take(self, newer_than):
            self.calls += 1
            if self.calls in self.at:
                self.post(weights[(newer_than + 1) % 2], newer_than + 1)
            return super().take(newer_than)

    def sampler(mode):
        return AgentSampler(
            config, tokenizer, None,
            RolloutSettings(num_slots=args.slots, chunk=args.chunk, show_tool_time=False,
                            on_weight_update=mode),
            RolloutLimits(max_turns=1, max_response_tokens=args.max_response_tokens,
                          max_prompt_tokens=max(map(len, prompts))),
            SamplingParams(temperature=1.0), fmt=TOY_FORMAT)

    probe = sampler("keep")
    probe.rollout(weights[0], prompts, args.samples, seed=0)
    calls = probe._engine.decode_calls
    print(f"{args.questions} questions x {args.samples} samples, {args.slots} slots, chunk "
          f"{args.chunk}, {args.layers} layers x {args.hidden}; {calls} decode calls without "
          f"updates")
    settings = [(mode, u) for mode in args.modes for u in args.updates
                if u or mode == args.modes[0]]  # the mode only matters when weights arrive
    samplers = {setting: sampler(setting[0]) for setting in settings}
    runs = {setting: [] for setting in settings}
    # Settings take turns within each repeat, so that a change in the machine's load hits all.
    for seed in range(-args.warmups, args.repeats):
        for (mode, u), s in samplers.items():
            s.weight_updates = Evenly([round(calls * (i + 1) / (u + 1)) + 1 for i in range(u)])
            _, stats = s.rollout(weights[0], prompts, args.samples, seed=seed + 1000)
            if seed >= 0:
                runs[mode, u].append((stats.weight_updates, stats.tokens_per_s, stats.wall_s,
                                      stats.generated_tokens, s._engine.recomputed_rows))
    print(f"{'mode':>9} {'updates':>7} {'tok/s':>7} {'wall s':>7} {'tokens':>7} "
          f"{'recomputed rows':>15}")
    for (mode, u), results in runs.items():
        taken, tok, wall, n, rec = (statistics.median(x) for x in zip(*results))
        print(f"{mode if u else '-':>9} {taken:>7.0f} {tok:>7.0f} {wall:>7.2f} {n:>7.0f} "
              f"{rec:>15.0f}")


if __name__ == "__main__":
    main()
