"""Padded against packed update batches of the same sequences: XLA's count of the compiled
update against the useful model FLOPs, the padding share of the tokens computed, tokens/s.

    python experiments/benchmarks/bench_packed_update.py --preset stage1-early --cost-only
    python experiments/benchmarks/bench_packed_update.py --preset stage1-late --cost-only
    python experiments/benchmarks/bench_packed_update.py --preset sft-function-calling --cost-only
    python experiments/benchmarks/bench_packed_update.py --preset stage1-late --model qwen3-30m \\
        --length-scale 0.125 --sequences 16                          # timed steps, CPU-sized

Presets draw sequence lengths (seed 0): the paper's stage 1 (rStar2-Agent §4.3), prompts of
150-450 tokens and responses log-normal (sigma 0.8) of mean 1,000 ("early") or 4,000 ("late")
tokens, cut at the 8,192-token response budget (the share cut is printed); rows padded to
2,048 + 8,192 tokens as `make_batch` pads them. "sft-function-calling": conversations
log-normal of mean 700 tokens, at most 4,096 (`seq_len` of experiments/paper/sft.yaml), half of
each the assistant's. The update is the RL step of bench_train_step.py (GRPO-RoC's clipped loss
through chunked log-probs, AdamW) for the stage-1 presets and the SFT loss for the SFT one, on
padded rows (one sequence per row, attention by row lengths) and on packed rows
(`rstar2_jax.train.packing`, attention within each sequence).

Timed steps (without --cost-only) print real tokens/s and, on an accelerator with a datasheet
peak in bench_train_step.py, the useful MFU: useful FLOPs / step time / peak.

Useful FLOPs = 6 x matmul params x real tokens + causal attention within each real sequence
(bench_train_step's count on the real lengths). Padded rows: XLA's cost analysis of the step
compiled here (attention scores whole rows, query-chunked on accelerators); the attention's
part of it is the step's count minus that of the same step with attention taken out. Packed
rows, XLA path (ROCm, TPU, GPU float32; CPU rows over 512 tokens): the block-skipping kernel
(`packed_attention._packed_attention`) runs lax while loops, whose body XLA's cost analysis
counts once, so its line is XLA's count without attention plus the kernel's work counted on the
host by the kernel's own plan (`packed_attention.packed_block_visits`: the block pairs it
computes, its groups' masked ends included) x FLOPs per block pair (forward: scores and output, 2 matmuls;
backward: scores recomputed, d_v, d_probs, d_k, d_q, 5 matmuls; the forward twice with
--remat). The cuDNN path (NVIDIA, bfloat16) scores only within each sequence, and XLA:GPU
leaves its kernel out of the count: its line is XLA's count without attention plus the useful
attention (x 4/3 with --remat, which runs the forward twice).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from bench_train_step import (MODELS, OPTIMIZER, _abstract_inputs, _flop, device_peak,
                              matmul_params, rl_step, time_steps, xla_cost)
from rstar2_jax.model import packed_attention, transformer
from rstar2_jax.model.params import init_params
from rstar2_jax.train.configs import PrecisionConfig, RLConfig
from rstar2_jax.train.packing import PackShapes, gather_index, pack, pack_tokens
from rstar2_jax.train.sft import sft_loss
from rstar2_jax.train.step import TrainState, make_train_step


@dataclasses.dataclass(frozen=True)
class Preset:
    kind: str  # "rl" or "sft"
    mean: int  # response (rl) or conversation (sft) tokens
    cap: int  # most response (rl) or conversation (sft) tokens
    budget: int  # padded row length
    prompt: tuple[int, int] = (150, 450)


PRESETS = {
    "stage1-early": Preset("rl", 1000, 8192, 2048 + 8192),
    "stage1-late": Preset("rl", 4000, 8192, 2048 + 8192),
    "sft-function-calling": Preset("sft", 700, 4096, 4096),
}


def sample_lengths(preset: Preset, n: int, scale: float, rng) -> tuple[np.ndarray, np.ndarray, float]:
    """(tokens [n], loss start [n], share cut at the cap) of n sequences."""
    sigma = 0.8
    draw = rng.lognormal(np.log(preset.mean) - sigma**2 / 2, sigma, n)
    if preset.kind == "rl":
        response = np.minimum(draw.astype(int) + 1, preset.cap)
        prompt = rng.integers(*preset.prompt, n)
        cut = float(np.mean(response == preset.cap))
        total, start = prompt + response, prompt
    else:
        total = np.minimum(draw.astype(int) + 2, preset.cap)
        cut, start = float(np.mean(total == preset.cap)), total // 2
    total = np.maximum((total * scale).astype(int), 2)
    return total, np.minimum((start * scale).astype(int), total - 1), cut


def attention_flops(config, lengths) -> float:
    """Causal attention of a train step (forward + backward) over sequences of ``lengths``."""
    per_pair = 3 * 2 * 2 * config.num_heads * config.head_dim * config.num_layers
    return per_pair * float(np.sum(np.asarray(lengths, np.float64) ** 2)) / 2


def batches(preset: Preset, lengths, starts, budget: int, micro_batches: int, vocab: int, rng):
    """(padded, packed) host batches of the same sequences, as the update's loss takes them."""
    n, seq = len(lengths), budget
    tokens = rng.integers(0, vocab, (n, seq)).astype(np.int32)
    real = np.arange(seq)[None] < lengths[:, None]
    loss_mask = real & (np.arange(seq)[None] >= starts[:, None])
    packing = pack(lengths, PackShapes(budget, row_multiple=1), groups=micro_batches)
    rows = pack_tokens(tokens, lengths, packing, pad_id=0)
    segment_lengths = packing.segment_lengths(lengths)
    if preset.kind == "sft":
        padded = {"tokens": tokens, "attention_mask": real.astype(np.int32),
                  "loss_mask": loss_mask.astype(np.int32)}
        packed_mask = np.zeros(rows.shape, np.int32)
        for i, (row, start) in enumerate(packing.places(lengths)):
            packed_mask[row, start + 1:start + lengths[i]] = loss_mask[i, 1:lengths[i]]
        packed = {"tokens": rows, "loss_mask": packed_mask, "segment_lengths": segment_lengths}
        return padded, packed, packing
    per_target = {"mask": loss_mask[:, 1:], "advantages": rng.normal(size=n).astype(np.float32),
                  "old_logp": np.full((n, seq - 1), -np.log(vocab), np.float32)}
    padded = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
              "attention_mask": real[:, :-1].astype(np.int32)} | per_target
    packed = {"inputs": rows[:, :-1], "targets": rows[:, 1:], "segment_lengths": segment_lengths,
              "gather": gather_index(packing, lengths, seq, micro_batches)} | per_target
    return padded, packed, packing


def block_attention_flops(config, segment_lengths, t: int, group: int, remat: bool) -> tuple[float, int, int]:
    """(FLOPs, forward block pairs, backward block pairs) of the block-skipping kernel in a
    train step over packed rows of t tokens (see the module docstring)."""
    block = packed_attention._BLOCK
    forward, backward = packed_attention.packed_block_visits(segment_lengths, t, block, group)
    per_matmul = 2 * block**2 * config.head_dim * config.num_heads * config.num_layers
    return (forward * 2 * (2 if remat else 1) + backward * 5) * per_matmul, forward, backward


class _NoAttention:
    """While active, the model's attention returns its queries (XLA's count without it)."""

    def __enter__(self):
        self.attention = transformer.attention
        transformer.attention = lambda q, k, v, *_, **__: q
        jax.clear_caches()  # jitted functions traced with attention

    def __exit__(self, *_):
        transformer.attention = self.attention
        jax.clear_caches()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="stage1-early")
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen3-0.6b")
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--length-scale", type=float, default=1.0,
                        help="multiplies every length and the row budget (timed runs on CPU)")
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--params", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--compute", choices=["auto", "float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--remat", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cost-only", action="store_true",
                        help="only XLA's cost analysis (abstract inputs: nothing allocated)")
    parser.add_argument("--json", help="also write the timed steps here")
    args = parser.parse_args()

    preset = PRESETS[args.preset]
    policy = PrecisionConfig(params=args.params, compute=args.compute)
    config = dataclasses.replace(MODELS[args.model], dtype=args.params)
    rl = RLConfig(remat=args.remat)
    rng = np.random.default_rng(0)
    lengths, starts, cut = sample_lengths(preset, args.sequences, args.length_scale, rng)
    budget = int(preset.budget * args.length_scale)
    padded, packed, packing = batches(preset, lengths, starts, budget, args.micro_batches,
                                      config.vocab_size, rng)

    def make_step(model_config):
        if preset.kind == "rl":
            return rl_step(model_config, policy, rl, args.micro_batches)
        loss = functools.partial(sft_loss, model_config=policy.compute_config(model_config),
                                 remat=args.remat)
        return make_train_step(loss, OPTIMIZER, micro_batches=args.micro_batches)

    real = int(lengths.sum())
    dense = 6 * matmul_params(config) * real
    useful_attention = attention_flops(config, lengths)
    useful = dense + useful_attention
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}")
    print(f"model: {args.model}, {matmul_params(config) / 1e6:.1f}M matmul params; params "
          f"{policy.params}, compute {policy.compute_dtype}, remat {args.remat}, micro-batches "
          f"{args.micro_batches}")
    print(f"preset {args.preset}: {args.sequences} sequences, {real:,} tokens (mean "
          f"{lengths.mean():,.0f}, longest {lengths.max():,}), {cut:.1%} cut at the cap; "
          f"useful FLOPs {_flop(useful)} (6 x params x tokens {_flop(dense)} + causal attention "
          f"within each sequence {_flop(useful_attention)})")
    remat_factor = 4 / 3 if args.remat else 1.0
    results = {}
    for name, batch in (("padded", padded), ("packed", packed)):
        rows, row_tokens = batch["tokens" if preset.kind == "sft" else "inputs"].shape
        row_tokens += preset.kind == "rl"
        computed = rows * row_tokens

        def abstract(shallow, batch=batch):
            state = _abstract_inputs(shallow, OPTIMIZER, jnp.dtype(args.params), 1, 2)[0]
            return state, {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch.items()}

        with _NoAttention():
            without = xla_cost(make_step, config, OPTIMIZER, None, 0, 0, abstract)["flops"]
        cudnn = without + useful_attention * remat_factor
        shape = f"{rows} x {row_tokens}" + (f", {packing.segments} segment slots"
                                            if name == "packed" else "")
        print(f"{name}: {shape} = {computed:,} tokens computed, padding {1 - real / computed:.1%}")
        if name == "padded":
            cost = xla_cost(make_step, config, OPTIMIZER, None, 0, 0, abstract)["flops"]
            path, attention = "XLA cost (whole rows, CPU / query-chunked path)", cost - without
        else:
            t = row_tokens - 1  # the model's inputs drop each row's last token
            attention, forward, backward = block_attention_flops(
                config, batch["segment_lengths"], t, packed_attention._GROUP, args.remat)
            cost = without + attention
            cpu = block_attention_flops(config, batch["segment_lengths"], t, 1, args.remat)[0]
            path = (f"XLA path, block skipping ({forward:,} forward / {backward:,} backward "
                    f"block pairs of {packed_attention._BLOCK} in groups of "
                    f"{packed_attention._GROUP}; CPU, one item a group: "
                    f"{(without + cpu) / useful:.2f}x)")
        print(f"  {path}: {_flop(cost)} = {cost / useful:.2f}x useful; attention "
              f"{_flop(attention)} ({attention / cost:.0%} of it), the rest {_flop(without)} "
              f"({without / dense:.2f}x 6 x params x tokens)")
        print(f"  cuDNN path (attention within sequences): {_flop(cudnn)} = {cudnn / useful:.2f}x "
              f"useful; attention {_flop(useful_attention * remat_factor)} "
              f"({useful_attention * remat_factor / cudnn:.0%})")
        results[name] = batch
    if args.cost_only:
        return

    params = jax.tree.map(lambda x: x.astype(args.params), init_params(config, jax.random.key(0)))
    step = make_step(config)
    timed = []
    for name, batch in results.items():
        state = TrainState(jax.tree.map(jnp.copy, params), OPTIMIZER.init(params),
                           jnp.zeros((), jnp.int32))
        compile_seconds, seconds = time_steps(step, state, jax.device_put(batch), args.repeats)
        peak, source = device_peak(policy.compute_dtype)
        print(f"{name}: first step {compile_seconds:.1f} s, then {seconds:.3f} s median of "
              f"{args.repeats} -> {real / seconds:,.0f} real tokens/s"
              + (f", useful MFU {useful / seconds / peak:.1%} ({source})" if peak else ""))
        timed.append({"layout": name, "preset": args.preset, "sequences": args.sequences,
                      "micro_batches": args.micro_batches, "remat": args.remat,
                      "first_step_s": compile_seconds, "step_s": seconds,
                      "real_tokens_per_s": real / seconds, "useful_flops": useful,
                      "useful_mfu": useful / seconds / peak if peak else None})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(timed, f, indent=1)


if __name__ == "__main__":
    main()
