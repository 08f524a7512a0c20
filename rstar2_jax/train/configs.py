"""Frozen dataclass configs for the training jobs.

Defaults are the paper's (rStar2-Agent §4-5 and the released verl recipe): AdamW at lr 1e-6,
constant after 20 linear warmup steps, weight decay 0.01, global-norm clip 1.0; GRPO-RoC
(Clip-Higher 0.2/0.28, no KL and no entropy term, no reference policy); temperature 1.0; 2G = 32 rollouts per
question, G = 16 kept; 512 questions per step.

Load them with :func:`rstar2_jax.config.load_config` (YAML + ``key=value`` overrides).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from omegaconf import MISSING

from rstar2_jax import chat
from rstar2_jax.algorithms import KL_PENALTIES, RolloutCorrection, resolve_algorithm
from rstar2_jax.algorithms.regularizers import KLPenalty
from rstar2_jax.model import ModelConfig, target
from rstar2_jax.sampler import RolloutLimits, RolloutSettings


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass(frozen=True)
class ModelSource:
    """Initial weights: a Hugging Face checkpoint directory (config.json + safetensors), its
    tokenizer, and the chat format (system prompt and user template) the model is trained with:
    a name registered with :func:`rstar2_jax.chat.register_format` ("rstar2" is built in)."""

    path: str = MISSING
    tokenizer: str | None = None  # defaults to ``path``
    chat_format: str = "rstar2"

    def __post_init__(self):
        _check(self.chat_format in chat.format_names(),
               f"model.chat_format must be one of {', '.join(chat.format_names())} (formats "
               f"registered with rstar2_jax.chat.register_format), got {self.chat_format!r}")

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.path


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh ("fsdp", "tp"); ``fsdp=None`` uses every training device not used by tp.

    ``rollout_devices`` (RL only): each process's last that many local devices serve its
    sampler instead of training, so that rollouts and updates run at once on disjoint devices
    under ``rl.max_staleness`` > 0 (`rstar2_jax.parallel.roles`); the mesh spans the other devices.
    0, the default: every device trains and the sampler serves on the trainer's devices.
    """

    fsdp: int | None = None
    tp: int = 1
    rollout_devices: int = 0

    def __post_init__(self):
        _check(self.tp >= 1, f"mesh.tp must be >= 1, got {self.tp}")
        _check(self.fsdp is None or self.fsdp >= 1, f"mesh.fsdp must be >= 1, got {self.fsdp}")
        _check(self.rollout_devices >= 0,
               f"mesh.rollout_devices must be >= 0, got {self.rollout_devices}")


@dataclass(frozen=True)
class PrecisionConfig:
    """The precision policy of a training job (docs/accelerators.md#precision).

    ``params`` is the dtype of the params and of AdamW's moments, the master weights the
    optimizer updates: float32 by default, because in bfloat16 an update smaller than half a
    unit in the last place of its weight (2**-9 of it: lr 1e-6 on a weight of 0.01) rounds
    away. A checkpoint stored in bfloat16 is loaded into float32 master weights.
    ``compute`` is the dtype the forward and backward passes run in: the activations and every
    matmul. Weights are cast to it where they are used, inside the differentiated function, so
    gradients, their accumulation over micro-batches and AdamW stay in ``params``' dtype. "auto"
    is bfloat16 on GPU and TPU, float32 on CPU (where XLA emulates bfloat16 matmuls): the
    device programs are compiled for (`rstar2_jax.model.target.current`). Logits,
    log-softmax, log-probs and the loss are float32 under any policy.
    ``matmul`` is the precision of float32 matmuls: "highest" is a true float32 product on
    every backend (parity tests, and the sampler/trainer log-prob gap, mean the same
    everywhere); "high" and "default" let a GPU use TF32 and a TPU fewer bfloat16 passes.
    The sampler's dtype is ``rollout.serving_dtype`` (auto: bfloat16 on GPU and TPU, the
    compute dtype on CPU).
    """

    params: Literal["float32", "bfloat16"] = "float32"
    compute: Literal["auto", "float32", "bfloat16"] = "auto"
    matmul: Literal["highest", "high", "default"] = "highest"

    @property
    def compute_dtype(self) -> str:
        if self.compute != "auto":
            return self.compute
        return "bfloat16" if target.current().accelerator else "float32"

    def compute_config(self, config: ModelConfig) -> ModelConfig:
        """``config`` as the training forward runs it (compute dtype, matmul precision)."""
        return dataclasses.replace(config, dtype=self.compute_dtype, matmul_precision=self.matmul)


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with linear warmup then a constant or cosine learning rate, global-norm clipping.

    ``decay_steps`` (cosine only) counts from the end of warmup; ``None`` means "until the end of
    the job". ``final_lr_ratio`` is the cosine floor as a fraction of ``lr``.
    An update whose loss or gradient is NaN or infinite is skipped (`rstar2_jax.train.step`);
    after ``max_nonfinite_steps`` steps in a row with a skipped update the run stops.
    """

    lr: float = 1e-6
    schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = 20
    decay_steps: int | None = None
    final_lr_ratio: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    grad_clip: float = field(default=1.0, metadata={"infinity": "no clipping"})  # inf: no clipping
    max_nonfinite_steps: int = 3

    def __post_init__(self):
        _check(self.lr > 0, f"optimizer.lr must be > 0, got {self.lr}")
        _check(self.warmup_steps >= 0, f"optimizer.warmup_steps must be >= 0, got {self.warmup_steps}")
        _check(self.decay_steps is None or self.decay_steps >= 1,
               f"optimizer.decay_steps must be >= 1, got {self.decay_steps}")
        _check(0.0 <= self.final_lr_ratio <= 1.0,
               f"optimizer.final_lr_ratio must be in [0, 1], got {self.final_lr_ratio}")
        _check(0.0 <= self.b1 < 1.0 and 0.0 <= self.b2 < 1.0,
               f"optimizer.b1 and optimizer.b2 must be in [0, 1), got {self.b1}, {self.b2}")
        _check(self.eps > 0, f"optimizer.eps must be > 0 (AdamW divides by sqrt(v) + eps), got {self.eps}")
        _check(self.weight_decay >= 0, f"optimizer.weight_decay must be >= 0, got {self.weight_decay}")
        _check(self.grad_clip > 0, f"optimizer.grad_clip must be > 0, got {self.grad_clip}")
        _check(self.max_nonfinite_steps >= 1,
               f"optimizer.max_nonfinite_steps must be >= 1, got {self.max_nonfinite_steps}")


@dataclass(frozen=True)
class CheckpointConfig:
    """Save every ``every`` steps and at the end of the job; keep the newest ``keep``.

    ``save_signal``: on this signal the run finishes the step in flight, saves it at once
    (whether or not a save is due) and stops, for a scheduler that warns ahead of the end of a
    job (SLURM's ``--signal=USR1@300``: docs/checkpoints.md). Without it, SIGTERM and SIGHUP
    stop a job as Ctrl-C does: the step in flight is dropped, the newest saved step stays.
    """

    every: int = 10
    keep: int = 3
    save_signal: Literal["USR1", "USR2", "TERM", "HUP"] | None = None

    def __post_init__(self):
        _check(self.every >= 1, f"checkpoint.every must be >= 1, got {self.every}")
        _check(self.keep >= 1, f"checkpoint.keep must be >= 1, got {self.keep}")


@dataclass(frozen=True)
class SFTConfig:
    """Supervised fine-tuning on chat-formatted JSONL (one message list per line).

    The paper's non-reasoning SFT: 3 epochs, lr 5e-6, 4% warmup, cosine decay, batch 128.
    ``batch_size`` and ``micro_batch_size`` count sequences of ``seq_len`` tokens; longer
    conversations are rejected, not silently truncated. ``packed`` (the default) packs each
    batch's conversations into rows of ``seq_len`` tokens, each attending only to itself
    (`rstar2_jax.train.packing`): the same loss and gradients as one conversation per row
    padded to ``seq_len`` (``packed=false``), for the tokens of the conversations rather than of
    the padding; the update compiles once per packed row count it meets (docs/benchmarks.md,
    "Packed update batches"). ``digit_loss_weight`` weighs the
    target tokens that are digits in the (then weighted) token mean: a small model trained from
    scratch learns to copy numbers far later than everything else (docs/toy.md), and a larger
    weight on digits brings that forward. 1.0 (the paper's plain token mean) by default.
    """

    model: ModelSource = field(default_factory=ModelSource)
    data: str = MISSING
    run_dir: str = MISSING
    seq_len: int = 4096
    batch_size: int = 128
    micro_batch_size: int | None = None  # None: the whole batch in one forward/backward
    epochs: int = 3
    seed: int = 0
    remat: bool = False
    packed: bool = True
    digit_loss_weight: float = 1.0
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optimizer: OptimizerConfig = field(
        default_factory=lambda: OptimizerConfig(lr=5e-6, schedule="cosine", warmup_steps=0))
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)

    def __post_init__(self):
        _check(self.seq_len >= 2, f"seq_len must be >= 2, got {self.seq_len}")
        _check(self.epochs >= 1, f"epochs must be >= 1, got {self.epochs}")
        _check(self.digit_loss_weight > 0,
               f"digit_loss_weight must be > 0, got {self.digit_loss_weight}")
        _check(self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}")
        _check(self.micro_batch_size is None
               or (self.micro_batch_size >= 1 and self.batch_size % self.micro_batch_size == 0),
               f"micro_batch_size ({self.micro_batch_size}) must divide batch_size ({self.batch_size})")
        _check(self.mesh.rollout_devices == 0,
               f"mesh.rollout_devices={self.mesh.rollout_devices} keeps devices for a sampler, "
               "and SFT has none: every device trains")


@dataclass(frozen=True)
class RLConfig:
    """What one RL step samples, keeps and optimizes, and with which algorithm.

    Per question ``rollouts_per_question`` (n) rollouts are scored. ``algorithm`` names the
    `rstar2_jax.algorithms.Algorithm` that selects the rollouts to train on (GRPO-RoC, the
    default, drops groups of equal rewards and keeps ``group_size`` (G) of 2G), computes their
    advantages and defines the loss: a name of ``rstar2_jax.algorithms.ALGORITHMS`` or an import
    path ``package.module:object``. The kept rollouts are split into ``mini_batches`` optimizer
    updates, each accumulated over as many micro-batches as its rollouts fill, of one shape
    for the run: ``micro_batch_size`` rows of the prompt + response budget per forward/backward
    (its activation memory; default one row per ``mesh.fsdp`` device). ``packed`` (the default)
    packs several rollouts into a row, each attending only to itself
    (`rstar2_jax.train.packing`): the same loss, metrics and gradients as one rollout per row
    padded to the budget (``packed=false``), for the tokens of the rollouts rather than of the
    padding. The update compiles six programs, whatever a step keeps (`rstar2_jax.rl.update`;
    docs/benchmarks.md, "Compilation of the main job").

    ``rollout_correction`` corrects the update of any algorithm for the gap between the
    sampler's log-probs and the trainer's (importance weights, masking; off by default:
    `rstar2_jax.algorithms.RolloutCorrection`). ``first_step_gap_limit`` guards the first
    update of a run: when the log-perplexity of its rollouts under the trainer and under the
    sampler differ by more (nats per token, averaged over sequences:
    ``logprob_mismatch/log_ppl_abs_diff``), the run stops before the update, naming the likely
    causes. bfloat16 serving of a dense model stays far below the default 0.05 (the toy:
    ~0.001); a sampling temperature other than ``temperature`` (the toy: 0.05 at 0.5 against
    1.0, 0.3 at 1.5) or weights from another checkpoint go above it; None turns the check off.

    ``entropy_coef`` and ``kl_coef`` add an entropy bonus and a KL penalty to the reference
    policy to any algorithm's loss, aggregated as that loss aggregates (``kl_penalty`` picks
    the per-token KL estimate, verl's names: `rstar2_jax.algorithms.regularizers`); 0, the
    paper's setting, adds nothing. ``reference`` keeps the stage's initial weights, frozen, as
    the reference policy: its log-probs of each step's tokens are computed with the old ones
    (one more forward, no backward) and given to losses that take ``ref_logp``, and the step
    logs ``ref_kl``. It costs a copy of the weights in the compute dtype; off (the default)
    it costs nothing. ``kl_coef`` needs it.

    ``max_staleness`` (k): the rollouts of step s are sampled by the policy after update
    s - k (at most k updates old) while the trainer updates on earlier steps' rollouts
    (`rstar2_jax.rl.loop`, docs/algorithms.md "Asynchronous RL"); 0, the default, is the
    synchronous loop: each step's rollouts come from the params it trains. On several
    processes it needs ``mesh.rollout_devices`` > 0.
    """

    questions_per_step: int = 512
    rollouts_per_question: int = 32
    group_size: int = 16
    algorithm: str = "grpo_roc"
    temperature: float = 1.0
    max_prompt_tokens: int = 2048
    mini_batches: int = 1
    micro_batch_size: int | None = None  # rows of the budget per pass; None: one per fsdp device
    logprob_chunk: int = 256  # sequence positions per chunk of the [batch, chunk, vocab] logits
    remat: bool = False
    packed: bool = True
    rollout_correction: RolloutCorrection = field(default_factory=RolloutCorrection)
    first_step_gap_limit: float | None = 0.05
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    kl_penalty: KLPenalty = "low_var_kl"
    reference: bool = False
    max_staleness: int = 0

    def __post_init__(self):
        _check(self.questions_per_step >= 1,
               f"rl.questions_per_step must be >= 1, got {self.questions_per_step}")
        _check(1 <= self.group_size <= self.rollouts_per_question,
               f"rl.group_size must be in [1, rl.rollouts_per_question={self.rollouts_per_question}], "
               f"got {self.group_size}")
        try:
            resolve_algorithm(self.algorithm)
        except ValueError as e:
            raise ValueError(f"rl.algorithm: {e}") from None
        _check(self.temperature > 0, f"rl.temperature must be > 0, got {self.temperature}")
        _check(self.mini_batches >= 1, f"rl.mini_batches must be >= 1, got {self.mini_batches}")
        _check(self.micro_batch_size is None or self.micro_batch_size >= 1,
               f"rl.micro_batch_size must be >= 1, got {self.micro_batch_size}")
        _check(self.logprob_chunk >= 1, f"rl.logprob_chunk must be >= 1, got {self.logprob_chunk}")
        _check(self.first_step_gap_limit is None or self.first_step_gap_limit > 0,
               f"rl.first_step_gap_limit must be > 0 or null, got {self.first_step_gap_limit}")
        _check(self.entropy_coef >= 0, f"rl.entropy_coef must be >= 0, got {self.entropy_coef}")
        _check(self.kl_coef >= 0, f"rl.kl_coef must be >= 0, got {self.kl_coef}")
        _check(self.kl_penalty in KL_PENALTIES,
               f"rl.kl_penalty must be one of {', '.join(KL_PENALTIES)}, got {self.kl_penalty!r}")
        _check(self.kl_coef == 0 or self.reference,
               f"rl.kl_coef={self.kl_coef} penalises the KL to the reference policy, and there is "
               f"none: set rl.reference=true (the stage's initial weights)")
        _check(self.max_staleness >= 0, f"rl.max_staleness must be >= 0, got {self.max_staleness}")


@dataclass(frozen=True)
class EvalConfig:
    """Agentic sampling of a problem set with a fixed policy (a Hugging Face directory).

    Used by ``eval`` (average pass@1 and pass@k over ``samples`` samples per problem; the paper:
    16 samples, temperature 0.6, up to 30 turns and 30K tokens) and by ``hard-subset`` (the
    problems the policy does not solve ``samples``/``samples``; the paper: 8 samples of the
    step-385 policy). ``output`` is the per-sample JSONL (eval) or the kept problems (hard-subset).
    """

    model: ModelSource = field(default_factory=ModelSource)
    dataset: str = MISSING
    output: str = MISSING
    samples: int = 16
    temperature: float = 0.6
    max_turns: int = 30
    max_response_tokens: int = 30720
    max_prompt_tokens: int = 2048
    limit: int | None = None  # evaluate the first `limit` problems only
    seed: int = 0
    rollout: RolloutSettings = field(default_factory=RolloutSettings)

    @property
    def limits(self) -> RolloutLimits:
        return RolloutLimits(max_turns=self.max_turns, max_response_tokens=self.max_response_tokens,
                             max_prompt_tokens=self.max_prompt_tokens)

    def __post_init__(self):
        _check(self.samples >= 1, f"samples must be >= 1, got {self.samples}")
        _check(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        _check(self.max_turns >= 1, f"max_turns must be >= 1, got {self.max_turns}")
        _check(self.limit is None or self.limit >= 1, f"limit must be >= 1, got {self.limit}")


@dataclass(frozen=True)
class StageConfig:
    """One stage of the staged RL recipe (paper §4.3).

    A stage starts from the final checkpoint of the run in ``init_from`` (params, and the
    optimizer state unless ``reset_optimizer``), or from ``model.path`` when it is ``None``.
    """

    name: str = MISSING
    steps: int = MISSING
    dataset: str = MISSING
    max_response_tokens: int = 8192
    max_turns: int = 10
    reset_optimizer: bool = False
    init_from: str | None = None

    def __post_init__(self):
        _check(self.steps >= 1, f"stage.steps must be >= 1, got {self.steps}")
        _check(self.max_response_tokens >= 1,
               f"stage.max_response_tokens must be >= 1, got {self.max_response_tokens}")
        _check(self.max_turns >= 1, f"stage.max_turns must be >= 1, got {self.max_turns}")


@dataclass(frozen=True)
class HardSubsetConfig:
    """Problems the current policy has not mastered: ``samples`` rollouts each, drop k/k solved."""

    source: str = MISSING
    output: str = MISSING
    samples: int = 8

    def __post_init__(self):
        _check(self.samples >= 1, f"hard_subset.samples must be >= 1, got {self.samples}")


@dataclass(frozen=True)
class RLJobConfig:
    """One RL stage run: model, algorithm, stage limits, optimizer, checkpoints and mesh."""

    model: ModelSource = field(default_factory=ModelSource)
    run_dir: str = MISSING
    seed: int = 0
    rl: RLConfig = field(default_factory=RLConfig)
    rollout: RolloutSettings = field(default_factory=RolloutSettings)
    stage: StageConfig = MISSING
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    hard_subset: HardSubsetConfig | None = None

    @property
    def limits(self) -> RolloutLimits:
        """The stage's turn and response limits with the RL prompt limit."""
        return RolloutLimits(max_turns=self.stage.max_turns,
                             max_response_tokens=self.stage.max_response_tokens,
                             max_prompt_tokens=self.rl.max_prompt_tokens)

