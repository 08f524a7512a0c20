"""The RL update's programs as a run compiles them (`rstar2_jax.rl.update.RLUpdate`), on one step
of stage-1 lengths.

The step's rollouts (``--sequences`` of the ``--preset``'s lengths, drawn as
bench_packed_update.py draws them, seed 0) go through the trainer's own host-side layout
(`RLUpdate.host_micro_batches`: a mini-batch's rollouts packed first, then cut into
micro-batches of ``rl.micro_batch_size`` rows of the rollout budget), and the programs are the
`RLUpdate`'s own jitted functions, lowered at that one micro-batch shape:

- ``update``: a micro-batch's gradient added to the accumulator (`add_micro_batch`), run once
  per micro-batch the step fills, and the optimizer update (`apply_update`), once per
  mini-batch;
- ``old-logprobs``: the log-prob pass before them (`_logprob_pass`: old log-probs and
  entropies written into the step's layout), once per micro-batch.

Their FLOPs x their runs a step are set against the model's count on the step's real tokens:
6 x matmul params x tokens (2 x for the log-prob pass) + causal attention within each rollout
(`bench_packed_update.attention_flops`).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from aot.programs import Program, abstract_params, tree_bytes
from bench_packed_update import PRESETS as LENGTH_PRESETS, attention_flops, sample_lengths
from bench_train_step import OPTIMIZER, matmul_params
from rstar2_jax.algorithms import GRPO_ROC
from rstar2_jax.model import ModelConfig
from rstar2_jax.parallel.sharding import batch_spec, param_specs
from rstar2_jax.rl.update import RLUpdate, step_layout, train_layout
from rstar2_jax.train.configs import PrecisionConfig, RLConfig
from rstar2_jax.train.step import TrainState, state_shardings


@dataclasses.dataclass
class Step:
    """One step's update as the trainer lays it out: abstract arguments of its programs."""

    update: RLUpdate
    lengths: np.ndarray  # tokens of each rollout
    micro: list[dict]  # the step's micro-batches, host arrays (all mini-batches')
    mini_batches: int
    state: TrainState  # abstract: float32 params, AdamW moments
    layout: dict  # abstract: the step's layout before its log-prob passes (`step_layout`)
    train: dict  # and what the gradient programs read of it after the statistics

    @property
    def segments(self) -> np.ndarray:
        """The segment lengths of every row of every micro-batch `[rows, segments]`."""
        return np.concatenate([mb["segment_lengths"] for mb in self.micro])

    @property
    def computed(self) -> int:
        """Tokens the step's micro-batches compute, padding too."""
        return sum(mb["inputs"].size for mb in self.micro)

    def abstract(self, tree) -> dict:
        """Abstract arrays of a tree of host arrays, rows split as the update splits them."""
        rows = NamedSharding(self.update.mesh, batch_spec())
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rows), tree)

    def describe(self) -> str:
        tokens, computed = int(self.lengths.sum()), self.computed
        rows, t = self.micro[0]["inputs"].shape
        def many(n, what):
            return f"{n} {what}" + ("es" if n != 1 else "")

        return (f"{len(self.lengths)} sequences, {tokens:,} tokens in "
                f"{many(len(self.micro), 'micro-batch')} of {rows} x {t + 1} (padding "
                f"{1 - tokens / computed:.1%}), {many(self.mini_batches, 'mini-batch')}, remat "
                f"{self.update.config.remat}")


def _batch(config: ModelConfig, args) -> tuple[dict, np.ndarray]:
    """The update's input (`RLUpdate`: one rollout a row, right-padded to the rollout budget) of
    ``args.sequences`` rollouts of the preset's lengths, and their lengths."""
    rng = np.random.default_rng(0)
    preset = LENGTH_PRESETS[args.preset]
    lengths, starts, _ = sample_lengths(preset, args.sequences, args.length_scale, rng)
    seq = int(preset.budget * args.length_scale)
    position = np.arange(seq)[None]
    real = position < lengths[:, None]
    return {"tokens": rng.integers(0, config.vocab_size, (len(lengths), seq)).astype(np.int32),
            "attention_mask": real.astype(np.int32),
            "loss_mask": (real & (position >= starts[:, None])).astype(np.int32),
            "advantages": rng.normal(size=len(lengths)).astype(np.float32),
            "sampler_logp": np.zeros((len(lengths), seq), np.float32)}, lengths


def step(config: ModelConfig, args, mesh) -> Step:
    """The update of ``config`` (float32 master weights, bfloat16 compute, AdamW, GRPO-RoC's
    loss; ``--remat``, ``--micro-batch-rows``, ``--logprob-chunk``) on the mesh, and one step of
    it laid out."""
    master = dataclasses.replace(config, dtype="float32")
    policy = PrecisionConfig(params="float32", compute="bfloat16")
    rl = RLConfig(remat=args.remat, logprob_chunk=args.logprob_chunk,
                  micro_batch_size=args.micro_batch_rows)
    specs = param_specs(master, mesh)
    params = abstract_params(master, jnp.float32, None)
    update = RLUpdate(policy.compute_config(master), rl, OPTIMIZER, mesh=mesh, param_specs=specs,
                      params=params, loss=GRPO_ROC.loss)
    batch, lengths = _batch(master, args)
    batch = update.prepare(batch)
    plan = update.host_micro_batches(batch)
    state = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                         TrainState(params, jax.eval_shape(OPTIMIZER.init, params),
                                    jax.ShapeDtypeStruct((), jnp.int32)),
                         state_shardings(OPTIMIZER, params, mesh, specs))
    partial = Step(update, lengths, [mb for mini in plan for mb in mini], len(plan), state, {}, {})
    layout = partial.abstract(step_layout(batch))
    advantages, mask, _ = jax.eval_shape(update.step_statistics, layout)
    return dataclasses.replace(partial, layout=layout, train=train_layout(layout, advantages, mask))


def _model_counts(config: ModelConfig, s: Step, mesh, backward: bool) -> dict:
    """The model's counts of a step's work: 2 x matmul params per token forward (6 x with the
    backward) and causal attention within each rollout, on the real tokens and on every token
    computed; one chip's share."""
    forward = attention_flops(config, s.lengths) / 3  # the forward's third of a train step's
    attention = forward * (3 if backward else 1)
    dense = (6 if backward else 2) * matmul_params(config)
    return dict(model_flops=(dense * int(s.lengths.sum()) + attention) / mesh.size,
                computed_flops=(dense * s.computed + attention) / mesh.size,
                attention_fwd=forward / mesh.size)


def update_programs(config: ModelConfig, args, mesh) -> list[Program]:
    """The update's gradient program, once per micro-batch, and its optimizer update."""
    s = step(config, args, mesh)
    update = s.update
    micro = s.abstract(s.micro[0])
    gradient_inputs = jax.eval_shape(update.gradient_inputs, micro, s.train)
    acc = jax.eval_shape(update.zero_accumulator, s.state.params, gradient_inputs)
    # Held beside the programs' own buffers through the step: the step's layout (and the
    # statistics' advantages and mask: the old log-probs are the layout's) and its other
    # micro-batches (placed up front); beside the gradient program the optimizer state too.
    held = (tree_bytes(s.layout) + tree_bytes(s.train) - tree_bytes(s.train["old_logp"])
            + (len(s.micro) - 1) * tree_bytes(micro))
    shared = dict(fsdp=mesh.shape["fsdp"], tp=mesh.shape["tp"])
    gradient = Program(
        update.add_micro_batch, (s.state.params, acc, gradient_inputs), {},
        **_model_counts(config, s, mesh, backward=True),
        base_bytes=tree_bytes(s.state) + tree_bytes(s.state.params),  # + float32 gradients
        repeats=len(s.micro), beside=held + tree_bytes(s.state.opt_state),
        # The block kernel's loops run as long as the plan says: counted by hand. Its forward
        # runs again in the backward only with remat (without, `run_decoder` keeps its output
        # and statistics; tests/test_model_target.py counts its forward loops).
        segments=s.segments, forwards=2 if args.remat else 1, backwards=1, **shared,
        note=f"{args.preset}: {s.describe()}", name="a micro-batch's gradient (add_micro_batch)")
    optimizer = Program(update.apply_update, (s.state, acc), {}, model_flops=0.0,
                        base_bytes=tree_bytes(s.state) + tree_bytes(s.state.params),
                        repeats=s.mini_batches, beside=held, **shared,
                        note=f"{args.preset}: {s.describe()}", name="the optimizer update (apply_update)")
    return [gradient, optimizer]


def old_logprobs_program(config: ModelConfig, args, mesh) -> Program:
    """The update's log-prob pass, once per micro-batch, before the gradients."""
    s = step(config, args, mesh)
    params = s.state.params
    into = {k: s.layout[k] for k in ("old_logp", "entropy")}
    micro = s.abstract(s.micro[0])
    return Program(s.update.logprob_pass, (params, into, micro), {},
                   **_model_counts(config, s, mesh, backward=False), base_bytes=tree_bytes(s.state),
                   repeats=len(s.micro),
                   beside=tree_bytes(s.layout) - tree_bytes(into) + tree_bytes(s.state.opt_state)
                   + (len(s.micro) - 1) * tree_bytes(micro),
                   segments=s.segments, fsdp=mesh.shape["fsdp"], tp=mesh.shape["tp"],
                   note=f"{args.preset}: {s.describe()}; a micro-batch's log-prob pass "
                        "(_logprob_pass), forward only", name="_logprob_pass")
