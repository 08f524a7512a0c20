"""The main job: a CPU toy that trains tool use end to end, in minutes.

    python -m rstar2_jax demo [--tiny] [out=runs/demo] [key=value ...]   # fields of DemoConfig

Phases, in order, each timed (``<out>/`` holds everything it writes):

    sft       toy problems (train/test, disjoint), SFT demonstrations     data/
              whose programs ran in the real sandbox, a tokenizer; a
              random tiny Qwen3; supervised fine-tuning from scratch      init_model/ sft/ sft_model/
    eval_sft  held-out average pass@1 and pass@k of the SFT policy        eval_sft.jsonl
    rl        GRPO-RoC from the SFT policy                                rl/ rl_model/
    eval_rl   the same evaluation of the RL policy                        eval_rl.jsonl
    report    summary table (printed, summary.json), training curves     curves.png

``*_model/`` directories are Hugging Face checkpoints with their tokenizer; ``rl_model/`` is the
final policy. The demonstrations are deliberately imperfect (some answer from a mental
estimate, some make a tool call that fails before the right one, see
``rstar2_jax.toy.sft_data``), so the SFT policy leaves RL something to improve; the summary
compares the two policies on held-out problems. Running the job again with the same ``out``
resumes SFT and RL from their newest checkpoints (every ``sft.checkpoint.every`` SFT steps,
``SFT_CHECKPOINT_EVERY`` by default, every ``RL_CHECKPOINT_EVERY`` RL steps, and at the end).
docs/toy.md has the measured figures.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from rstar2_jax.algorithms import Algorithm
from rstar2_jax.compile_cache import CompileCounter, CompileStats
from rstar2_jax.data.datasets import load_problems
from rstar2_jax.evaluate import EvalReport, sample_problems, write_samples
from rstar2_jax.sampler.runtime import RolloutRuntime
from rstar2_jax.sampler import RolloutLimits, RolloutSettings
from rstar2_jax.sandbox import SandboxConfig
from rstar2_jax.toy.build import ToyDataConfig, build_toy_data
from rstar2_jax.toy.format import TOY_FORMAT
from rstar2_jax.toy.sft_data import DemoMix
from rstar2_jax.train.configs import (
    CheckpointConfig,
    MeshConfig,
    ModelSource,
    OptimizerConfig,
    PrecisionConfig,
    RLConfig,
    RLJobConfig,
    SFTConfig,
    StageConfig,
)
from rstar2_jax.train.sft_data import Conversations


@dataclass(frozen=True)
class ToyModel:
    """Shape of the from-scratch toy model: a Qwen3 (q/k RMSNorm, GQA, tied embeddings)."""

    hidden_size: int = 64
    intermediate_size: int = 192
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16


# Checkpoint intervals, in steps: about a minute of the main job's SFT (0.3 s a step on 2 cores)
# and of its RL (20-30 s a step), so Ctrl-C or a killed job loses at most that; a save holds a
# step for about 0.1 s at the main job's size (experiments/benchmarks/bench_checkpoint.py).
SFT_CHECKPOINT_EVERY = 200
RL_CHECKPOINT_EVERY = 2

# The settings of DemoConfig's job configs that the demo derives itself (`sft_config`,
# `rl_config`) -> what to set instead. They stay as `demo_sft` and `demo_stage` leave them;
# another value is an error, never silently replaced.
DERIVED = {
    "sft.model": "the model is a random toy model: set its shape in `model`",
    "sft.data": "the demonstrations are built from `data` under `out`",
    "sft.run_dir": "SFT runs in <out>/sft: set `out`",
    "sft.seq_len": "it is the longest demonstration's length (sft_seq_len): change `data`",
    "sft.seed": "set `seed` (it seeds SFT, RL and the evaluation)",
    "sft.precision": "set `precision` (SFT's and RL's)",
    "stage.dataset": "RL trains on the toy problems built from `data` under `out`",
}


def demo_sft(**settings) -> SFTConfig:
    """An `SFTConfig` for `DemoConfig.sft`: ``settings`` over the demo's checkpoints (every
    `SFT_CHECKPOINT_EVERY` steps, the newest kept) and mesh (one device), the `DERIVED` fields
    unset (the demo fills them in)."""
    return SFTConfig(**{"model": ModelSource(path="", chat_format="toy"), "data": "", "run_dir": "",
                        "checkpoint": CheckpointConfig(every=SFT_CHECKPOINT_EVERY, keep=1),
                        "mesh": MeshConfig(fsdp=1)} | settings)


def demo_stage(**settings) -> StageConfig:
    """A `StageConfig` for `DemoConfig.stage`: ``settings`` (``steps`` at least) over the name
    ``toy``, ``dataset`` unset (the demo fills it in)."""
    return StageConfig(**{"name": "toy", "dataset": ""} | settings)


# Sections whose DERIVED fields hold the values a DemoConfig must leave them at.
_UNSET = {"sft": demo_sft(), "stage": demo_stage(steps=1)}


@dataclass(frozen=True)
class DemoConfig:
    """Everything the main job does; the defaults are the toy run measured in docs/toy.md.

    Attributes:
      out: output directory.
      seed: seeds the model init, SFT order, RL sampling and evaluation.
      data: toy problems and demonstrations.
      model: the toy model's shape.
      sft: the supervised fine-tuning job (``sft.epochs``, ``sft.batch_size``,
        ``sft.optimizer``, ``sft.packed``, ``sft.digit_loss_weight``, ``sft.checkpoint``, ...).
        The demo sets its ``model``, ``data``, ``run_dir``, ``seq_len`` (the longest
        demonstration's, see ``sft_seq_len``, never a constant), ``seed`` and ``precision``
        itself; setting one of them here is an error (`DERIVED` names the field to use).
      rl, rl_optimizer, rollout: GRPO-RoC, its optimizer (``RLJobConfig.optimizer``) and the
        rollouts (``rollout``'s tool-output rendering and ``tool_session`` must match
        ``data``'s, so that RL shows the model what SFT showed it).
      stage: the RL stage: ``stage.steps``, and ``stage.max_turns`` and
        ``stage.max_response_tokens``, the rollout limits of RL and evaluation alike (see
        `limits`); ``stage.dataset`` is the toy's training problems (setting it is an error).
      precision: the precision policy of SFT and RL (``precision.compute=bfloat16`` trains
        with bfloat16 compute and float32 master weights, as on an accelerator); the evaluation
        serves the exported float32 weights under either policy.
      eval_problems, eval_samples, eval_temperature: the held-out evaluation (paper: 16 samples
        at temperature 0.6); pass@1 is averaged over the samples, pass@k is unbiased.
    """

    out: str = "runs/demo"
    seed: int = 0
    data: ToyDataConfig = field(default_factory=lambda: ToyDataConfig(n_train=2000, n_test=100))
    model: ToyModel = field(default_factory=ToyModel)
    # Copying the question's numbers into the program is the slow skill: the SFT loss sits at a
    # plateau (format learned, digits guessed) for ~450 steps at this learning rate, then drops.
    # 20 epochs leave ~700 steps after the escape to improve the copying.
    sft: SFTConfig = field(default_factory=lambda: demo_sft(
        epochs=20, batch_size=16, digit_loss_weight=5.0,
        optimizer=OptimizerConfig(lr=3e-3, schedule="constant", warmup_steps=10, weight_decay=0.0)))
    # Sampled at the evaluation temperature, not the paper's 1.0: at 1.0 the tiny model miscopies
    # so many digits that few groups hold a right answer, and RL gains nothing in 12 steps.
    # 32 questions a step: with 16, RoC kept 1-7 groups a step and a weak SFT policy drifted.
    rl: RLConfig = field(default_factory=lambda: RLConfig(
        questions_per_step=32, rollouts_per_question=8, group_size=4, temperature=0.6,
        max_prompt_tokens=64))
    stage: StageConfig = field(default_factory=lambda: demo_stage(
        steps=40, max_turns=4, max_response_tokens=320))
    rl_optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(
        lr=1e-3, warmup_steps=2, weight_decay=0.0))
    rollout: RolloutSettings = field(default_factory=lambda: RolloutSettings(
        num_slots=64, chunk=32, show_tool_time=False, sandbox=SandboxConfig(timeout_s=2.0)))
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    eval_problems: int = 64
    eval_samples: int = 8
    eval_temperature: float = 0.6

    @classmethod
    def smoke(cls, out: str) -> DemoConfig:
        """The fastest settings on the main job's task mix, for the testbed's pipeline test:
        every phase runs in about 20 s, but the model learns next to nothing and RL keeps no
        group (use `tiny` for a run that trains)."""
        return cls(
            out=out, data=ToyDataConfig(n_train=64, n_test=8, n_sft=32, vocab_size=400),
            model=ToyModel(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                           num_kv_heads=1, head_dim=16),
            sft=demo_sft(epochs=2, batch_size=8, digit_loss_weight=5.0,
                         optimizer=OptimizerConfig(lr=1e-2, warmup_steps=1, weight_decay=0.0)),
            rl=RLConfig(questions_per_step=4, rollouts_per_question=4, group_size=2,
                        max_prompt_tokens=128),
            stage=demo_stage(steps=2, max_turns=2, max_response_tokens=256),
            rl_optimizer=OptimizerConfig(lr=1e-3, warmup_steps=0, weight_decay=0.0),
            rollout=RolloutSettings(num_slots=16, chunk=16, show_tool_time=False,
                                    sandbox=SandboxConfig(timeout_s=2.0), sandbox_workers=1),
            eval_problems=4, eval_samples=2)

    @classmethod
    def tiny(cls, out: str = "runs/demo_tiny") -> DemoConfig:
        """The smallest run that learns (``python -m rstar2_jax demo --tiny``): every phase in
        about a minute on 2 cores, and its RL steps keep groups and update the policy (seed 0:
        2, 6, 3 and 6 groups of 8; another seed may keep fewer, and a step none).

        One problem kind, divisor counts, whose answers are mostly 4, 8, 12 or 16: a policy that
        has learnt the answer format after ~100 SFT steps already guesses right on about one
        rollout in four (a call to the tool needs the question's number copied, which takes the
        main job's 1000 SFT steps), so groups hold both right and wrong answers from the first
        RL step on. Demonstrations without a failing first call: their tracebacks would not fit
        the short response budget. docs/toy.md has the measured figures.
        """
        return cls(
            out=out, data=ToyDataConfig(n_train=256, n_test=16, n_sft=64, vocab_size=400,
                                        kinds=["divisor_count"],
                                        mix=DemoMix(tool=0.5, first_call_error=0.0, no_tool=0.5)),
            model=ToyModel(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                           num_kv_heads=1, head_dim=16),
            sft=demo_sft(epochs=30, batch_size=8, digit_loss_weight=5.0,
                         optimizer=OptimizerConfig(lr=1e-2, warmup_steps=1, weight_decay=0.0)),
            rl=RLConfig(questions_per_step=8, rollouts_per_question=4, group_size=2,
                        temperature=0.6, max_prompt_tokens=64),
            stage=demo_stage(steps=4, max_turns=2, max_response_tokens=160),
            rl_optimizer=OptimizerConfig(lr=1e-3, warmup_steps=0, weight_decay=0.0),
            rollout=RolloutSettings(num_slots=32, chunk=16, show_tool_time=False,
                                    sandbox=SandboxConfig(timeout_s=2.0), sandbox_workers=1),
            eval_problems=8, eval_samples=4)

    @property
    def limits(self) -> RolloutLimits:
        """Turn and token limits of every rollout, in RL and evaluation."""
        return RolloutLimits(max_turns=self.stage.max_turns,
                             max_response_tokens=self.stage.max_response_tokens,
                             max_prompt_tokens=self.rl.max_prompt_tokens)

    def __post_init__(self):
        for key, use in DERIVED.items():
            section, name = key.split(".")
            if getattr(getattr(self, section), name) != getattr(_UNSET[section], name):
                raise ValueError(f"{key} is set by the demo itself; {use}")
        if (self.rollout.tool_response_chars, self.rollout.show_tool_time, self.rollout.tool_session) != (
                self.data.tool_response_chars, self.data.show_tool_time, self.data.tool_session):
            raise ValueError(
                "rollout.tool_response_chars/show_tool_time/tool_session must equal data's "
                f"({self.data.tool_response_chars}, {self.data.show_tool_time}, {self.data.tool_session}): "
                "RL must run and render tools as the SFT demonstrations did")
        if not 1 <= self.eval_problems <= self.data.n_test:
            raise ValueError(f"eval_problems must be in 1..data.n_test={self.data.n_test}, "
                             f"got {self.eval_problems}")
        if self.rl.questions_per_step > self.data.n_train:
            raise ValueError(f"rl.questions_per_step={self.rl.questions_per_step} exceeds the "
                             f"data.n_train={self.data.n_train} training problems")
        if self.eval_samples < 1:
            raise ValueError(f"eval_samples must be >= 1, got {self.eval_samples}")


@dataclass(frozen=True)
class DemoSummary:
    """What the job measured: the evaluations of both policies, the wall time of each phase,
    what each phase compiled (``compiles["total"]`` for the whole job) and the groups each RL
    step kept (a step that kept none made no update)."""

    sft: EvalReport
    rl: EvalReport
    seconds: dict[str, float]
    compiles: dict[str, CompileStats]
    kept_groups: list[int]

    @property
    def steps_without_update(self) -> int:
        """RL steps whose selection kept no group, so that the policy did not change."""
        return sum(k == 0 for k in self.kept_groups)

    @property
    def gain(self) -> float:
        """Average pass@1 after RL minus after SFT (absolute, as a fraction)."""
        return self.rl.pass_at[1] - self.sft.pass_at[1]

    def table(self) -> str:
        """The summary as a fixed-width text table."""
        k = max(self.sft.pass_at)
        rows = [("avg pass@1", lambda r: f"{100 * r.pass_at[1]:.1f}%"),
                (f"pass@{k}", lambda r: f"{100 * r.pass_at[k]:.1f}%"),
                ("tool calls / sample", lambda r: f"{r.tool_calls_per_sample:.2f}"),
                ("tool error rate", lambda r: f"{100 * r.tool_error_rate:.1f}%"),
                ("response tokens", lambda r: f"{r.mean_response_tokens:.0f}"),
                ("truncated", lambda r: f"{100 * r.truncation_rate:.1f}%")]
        lines = [f"held-out: {self.sft.problems} problems x {self.sft.samples_per_problem} samples",
                 f"{'':<22}{'after SFT':>12}{'after RL':>12}"]
        lines += [f"{name:<22}{cell(self.sft):>12}{cell(self.rl):>12}" for name, cell in rows]
        lines.append(f"RL gain in avg pass@1: {100 * self.gain:+.1f} points")
        lines.append("groups kept per RL step: " + " ".join(map(str, self.kept_groups)))
        if self.steps_without_update:
            lines.append(f"WARNING: {self.steps_without_update} of {len(self.kept_groups)} RL steps "
                         "kept no group (all rewards of every group equal) and did not update the policy")
        lines.append("wall time: " + ", ".join(f"{p} {s:.0f} s" for p, s in self.seconds.items()))
        lines.append("compilation: " + self.compiles["total"].summary() + "; RL phase: "
                     + self.compiles["rl"].summary())
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"after_sft": dataclasses.asdict(self.sft), "after_rl": dataclasses.asdict(self.rl),
                "pass1_gain": self.gain, "seconds": self.seconds, "kept_groups": self.kept_groups,
                "compiles": {p: dataclasses.asdict(c) for p, c in self.compiles.items()}}


def toy_model_config(shape: ToyModel, tokenizer):
    """The ``ModelConfig`` of a toy model for ``tokenizer`` (its vocabulary and stop tokens)."""
    from rstar2_jax import chat
    from rstar2_jax.model import ModelConfig

    im_end = chat.token_id(tokenizer, chat.IM_END)
    return ModelConfig(
        model_type="qwen3", vocab_size=len(tokenizer), hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size, num_layers=shape.num_layers,
        num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
        qk_norm=True, tie_embeddings=True, rope_theta=10_000.0, max_position_embeddings=1024,
        eos_token_id=im_end, pad_token_id=tokenizer.pad_token_id)


def sft_seq_len(examples: Conversations, max_len: int) -> int:
    """SFT sequence length for the encoded demonstrations ``examples``: the longest one, rounded
    up to a multiple of 16, at most ``max_len`` (the model's positions, which ``examples`` were
    checked against). Tool output in the demonstrations is real (tracebacks differ between
    Python versions), so a fixed length would fail on some machine."""
    longest = max(len(ids) for ids, _ in examples)
    return min(-(-longest // 16) * 16, max_len)


def sft_config(cfg: DemoConfig, out: Path, seq_len: int) -> SFTConfig:
    """``cfg.sft`` with the settings the demo derives (`DERIVED`) filled in."""
    return dataclasses.replace(
        cfg.sft, model=ModelSource(path=str(out / "init_model"), chat_format="toy"),
        data=str(out / "data" / "sft.jsonl"), run_dir=str(out / "sft"), seq_len=seq_len,
        seed=cfg.seed, precision=cfg.precision)


def rl_config(cfg: DemoConfig, out: Path, name: str) -> RLJobConfig:
    """The RL job of ``cfg`` in run directory ``<out>/<name>``, from ``<out>/sft_model``."""
    return RLJobConfig(
        model=ModelSource(path=str(out / "sft_model"), chat_format="toy"),
        run_dir=str(out / name), seed=cfg.seed, rl=cfg.rl,
        stage=dataclasses.replace(cfg.stage, dataset=str(out / "data" / "train.jsonl")),
        precision=cfg.precision, optimizer=cfg.rl_optimizer,
        checkpoint=CheckpointConfig(every=RL_CHECKPOINT_EVERY, keep=1), mesh=MeshConfig(fsdp=1),
        rollout=cfg.rollout)


def weight_change(before: str | Path, after: str | Path) -> float:
    """The largest absolute difference between the weights of two Hugging Face model
    directories of one shape (0.0: the policy did not move, e.g. an RL run that never updated)."""
    import jax
    import numpy as np

    from rstar2_jax.model import load_hf

    (_, a), (_, b) = load_hf(before), load_hf(after)
    return max(float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def export_model(run_dir: Path, output: Path, tokenizer) -> None:
    """The newest checkpoint of ``run_dir`` as a Hugging Face model directory with its tokenizer."""
    from rstar2_jax.train.checkpoint import export_hf

    export_hf(run_dir / "checkpoints", output)
    tokenizer.save_pretrained(output)


def train_sft_policy(cfg: DemoConfig, sandbox, *, progress: bool = True) -> None:
    """Data, a random model and SFT from scratch: writes ``<out>/data`` and ``<out>/sft_model``."""
    import jax
    from transformers import AutoTokenizer

    from rstar2_jax.model import init_params, save_hf
    from rstar2_jax.train.sft import run_sft

    out = Path(cfg.out)
    build_toy_data(out / "data", cfg.data, sandbox)
    tokenizer = AutoTokenizer.from_pretrained(out / "data" / "tokenizer")
    model_config = toy_model_config(cfg.model, tokenizer)
    save_hf(out / "init_model", model_config, init_params(model_config, jax.random.key(cfg.seed)))
    tokenizer.save_pretrained(out / "init_model")
    # Encoded once: for the sequence length, and to train on.
    examples = Conversations(str(out / "data" / "sft.jsonl"), tokenizer, TOY_FORMAT,
                             model_config.max_position_embeddings)
    config = sft_config(cfg, out, sft_seq_len(examples, model_config.max_position_embeddings))
    run_sft(config, progress=progress, examples=examples)
    export_model(out / "sft", out / "sft_model", tokenizer)


def train_rl_policy(cfg: DemoConfig, name: str, runtime: RolloutRuntime, *,
                    algorithm: Algorithm | None = None, progress: bool = True) -> Path:
    """RL from ``<out>/sft_model`` in run directory ``<out>/<name>``, rollouts by ``runtime``,
    with ``algorithm`` (default: the one ``cfg.rl.algorithm`` names); returns the exported
    policy's directory ``<out>/<name>_model``."""
    from transformers import AutoTokenizer

    from rstar2_jax.rl.loop import run_rl

    out = Path(cfg.out)
    run_rl(rl_config(cfg, out, name), algorithm=algorithm, runtime=runtime, progress=progress)
    export_model(out / name, out / f"{name}_model", AutoTokenizer.from_pretrained(out / "sft_model"))
    return out / f"{name}_model"


class Evaluator:
    """The held-out evaluation of DemoConfig (``eval_*`` fields, the RL rollout limits) by
    ``runtime``, with one compiled sampler for every policy of the toy model's shape."""

    def __init__(self, cfg: DemoConfig, runtime: RolloutRuntime):
        from transformers import AutoTokenizer

        out = Path(cfg.out)
        self.cfg, self.runtime = cfg, runtime
        self.tokenizer = AutoTokenizer.from_pretrained(out / "data" / "tokenizer")
        self.model_config = toy_model_config(cfg.model, self.tokenizer)
        self.problems = load_problems(out / "data" / "test.jsonl")[:cfg.eval_problems]

    def __call__(self, model_dir: Path, samples_path: Path) -> EvalReport:
        """Evaluates the policy in ``model_dir``; one JSONL record per sample to ``samples_path``."""
        from rstar2_jax.model import load_hf

        model_config, params = load_hf(model_dir)
        if model_config != self.model_config:
            raise ValueError(f"{model_dir} holds a {model_config}, not the toy model {self.model_config}")
        report, records = sample_problems(
            self.runtime, model_config, params, self.tokenizer, self.problems,
            samples=self.cfg.eval_samples, temperature=self.cfg.eval_temperature,
            limits=self.cfg.limits, fmt=TOY_FORMAT)
        write_samples(samples_path, records)
        return report


def run_demo(cfg: DemoConfig = DemoConfig(), *, progress: bool = True) -> DemoSummary:
    """Runs the main job (see the module docstring) and returns what it measured.

    ``progress`` draws the SFT and RL progress bars and prints each phase as it starts (and, as
    it ends, what it compiled) and the summary table at the end.
    """
    from rstar2_jax.plots import plot_curves
    from rstar2_jax.train.metrics import read_metrics

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    seconds: dict[str, float] = {}
    compiles: dict[str, CompileStats] = {}
    start = time.perf_counter()

    @contextlib.contextmanager
    def phase(name: str, what: str):
        if progress:
            print(f"[{time.perf_counter() - start:4.0f} s] {name}: {what}", flush=True)
        phase_start, before = time.perf_counter(), counter.snapshot()
        yield
        seconds[name] = time.perf_counter() - phase_start
        compiles[name] = counter.snapshot() - before
        if progress:
            print(f"  {name}: {compiles[name].summary()}", flush=True)

    with CompileCounter() as counter, RolloutRuntime(cfg.rollout) as runtime:
        with phase("sft", f"toy data, a random model, supervised fine-tuning ({cfg.sft.epochs} epochs)"):
            train_sft_policy(cfg, runtime.sandbox, progress=progress)
        with phase("eval_sft", f"{cfg.eval_problems} held-out problems x {cfg.eval_samples} samples"):
            evaluator = Evaluator(cfg, runtime)
            after_sft = evaluator(out / "sft_model", out / "eval_sft.jsonl")
        if progress:
            print(f"  after SFT: {after_sft.summary()}", flush=True)
        with phase("rl", f"RL with {cfg.rl.algorithm}, {cfg.stage.steps} steps"):
            final = train_rl_policy(cfg, "rl", runtime, progress=progress)
        with phase("eval_rl", "the same evaluation of the RL policy"):
            after_rl = evaluator(final, out / "eval_rl.jsonl")
        if progress:
            print(f"  after RL:  {after_rl.summary()}", flush=True)
        with phase("report", f"curves.png, summary.json; the final model is {final}"):
            plot_curves({cfg.rl.algorithm: read_metrics(out / "rl")}, out / "curves.png")
        compiles["total"] = counter.snapshot()
    seconds["total"] = time.perf_counter() - start
    kept = [int(r["groups/kept"]) for r in read_metrics(out / "rl")]
    summary = DemoSummary(after_sft, after_rl, seconds, compiles, kept)
    (out / "summary.json").write_text(json.dumps(summary.to_json(), indent=2) + "\n")
    if progress:
        print(summary.table(), flush=True)
    return summary
