"""Evaluation: k agentic samples per problem, average pass@1 and unbiased pass@k.

The paper's protocol (§5.1): 16 samples per problem at temperature 0.6, average pass@1, up to 30
turns. `evaluate` runs any `AgentSampler` (its sampling settings and limits are the protocol) and
scores every sample with the verifier pool; `sample_problems` does so with the sampler and
verifier of a `RolloutRuntime`; `write_samples` keeps one JSONL line per sample; `run_eval` does
it all from an `EvalConfig`; `run_hard_subset` keeps the problems a policy does
not solve k/k (the paper's stage-3 data).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Sequence

import jax
import numpy as np

from rstar2_jax import chat
from rstar2_jax.data.datasets import Problem
from rstar2_jax.errors import ConfigError
from rstar2_jax.parallel.hosts import claims, gather, gather_questions
from rstar2_jax.runtime import RolloutRuntime, score_rollouts
from rstar2_jax.sampler import AgentSampler, RolloutLimits, SamplingParams
from rstar2_jax.sandbox.result import without_time
from rstar2_jax.tokenizer import open_tokenizer
from rstar2_jax.train.configs import EvalConfig, RLJobConfig


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al., 2021, eq. 1):
    `1 - C(n - c, k) / C(n, k)`, the chance that k samples drawn without replacement from the n
    contain a correct one."""
    if not 0 <= num_correct <= num_samples or not 1 <= k <= num_samples:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n; got n={num_samples}, "
                         f"c={num_correct}, k={k}")
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)


@dataclasses.dataclass(frozen=True)
class EvalReport:
    """Averages over problems (pass rates) and over samples (everything else)."""

    problems: int
    samples_per_problem: int
    pass_at: dict[int, float]  # k -> mean unbiased pass@k; pass_at[1] is average pass@1
    mean_response_tokens: float
    tool_calls_per_sample: float
    tool_error_rate: float  # failed calls / calls, over all samples
    truncation_rate: float
    wall_s: float

    def summary(self) -> str:
        rates = ", ".join(f"pass@{k} {100 * v:.1f}%" for k, v in sorted(self.pass_at.items()))
        return (f"{self.problems} problems x {self.samples_per_problem} samples: {rates}; "
                f"{self.mean_response_tokens:.0f} response tokens, "
                f"{self.tool_calls_per_sample:.2f} tool calls/sample "
                f"({100 * self.tool_error_rate:.1f}% failed), "
                f"{100 * self.truncation_rate:.1f}% truncated, {self.wall_s:.1f} s")


@dataclasses.dataclass(frozen=True)
class SampleRecord:
    """One evaluated sample, as written to the per-sample JSONL. ``tool_calls``: per call its
    ``code``, ``stdin``, ``status`` and ``response`` (the text the model read, less the
    execution-time line, so that reruns write the same records)."""

    problem: int
    sample: int
    question: str
    answer: str
    reward: float
    finish_reason: str
    response_tokens: int
    tool_calls: list[dict]
    response_text: str


def evaluate(sampler: AgentSampler, params, verifier, problems: Sequence[Problem], *,
             samples: int, fmt: chat.ChatFormat = chat.ChatFormat(),
             ks: Sequence[int] = (1,), seed: int = 0) -> tuple[EvalReport, list[SampleRecord]]:
    """Samples every problem `samples` times and scores each sample. Across several processes
    each takes problems from a shared queue as its rows free up (`rstar2_jax.parallel.hosts`) and every
    process returns the report and records of all of them, the same as one process's.

    Args:
      sampler: decides temperature, turn and token limits (paper: 0.6, 30 turns, 30K tokens).
      params: the policy.
      verifier: `submit(response_text, gold) -> Future[float]` (a `VerifierPool`).
      problems: questions and reference answers.
      samples: samples per problem (paper: 16).
      fmt: the chat format the policy was trained with.
      ks: the k of each pass@k to report (each <= samples).
      seed: sampling seed.
    """
    if samples < 1 or any(not 1 <= k <= samples for k in ks):
        raise ValueError(f"need samples >= 1 and every k in 1..samples; got {samples}, {ks}")
    prompts = [chat.encode_prompt(sampler.tokenizer, p.question, fmt) for p in problems]
    # Hosts take the problems from a shared queue as their rows free up (rstar2_jax.parallel.hosts).
    trajs, rewards, stats, _ = score_rollouts(sampler, verifier, params, problems, prompts,
                                              samples, seed, claim=claims(len(problems)))
    untimed = without_time if sampler.settings.show_tool_time else (lambda text: text)
    mine: dict[int, list[dict]] = {}
    for t in trajs:
        problem = problems[t.prompt_index]
        mine.setdefault(t.prompt_index, []).append(dataclasses.asdict(SampleRecord(
            problem=t.prompt_index, sample=t.sample_index,
            question=problem.question, answer=problem.answer,
            reward=float(rewards[t.prompt_index, t.sample_index]), finish_reason=t.finish_reason,
            response_tokens=len(t.response_ids),
            tool_calls=[{"code": c.code, "stdin": c.stdin, "status": c.status,
                         "response": untimed(c.response_text)} for c in t.tool_calls],
            response_text=t.response_text)))
    records = [SampleRecord(**r) for ran in gather_questions(len(problems), mine) for r in ran]
    wall_s = float(gather(np.array([stats.wall_s])).max())  # the slowest host's
    rewards = np.zeros((len(problems), samples), np.float32)
    for r in records:
        rewards[r.problem, r.sample] = r.reward
    correct = rewards.sum(axis=1).astype(int)
    calls = [c for r in records for c in r.tool_calls]
    report = EvalReport(
        problems=len(problems), samples_per_problem=samples,
        pass_at={k: float(np.mean([pass_at_k(samples, c, k) for c in correct])) for k in ks},
        mean_response_tokens=float(np.mean([r.response_tokens for r in records])),
        tool_calls_per_sample=len(calls) / len(records),
        tool_error_rate=sum(c["status"] != "ok" for c in calls) / max(len(calls), 1),
        truncation_rate=float(np.mean([r.finish_reason == "budget" for r in records])),
        wall_s=wall_s)
    return report, records


def sample_problems(runtime: RolloutRuntime, model_config, params, tokenizer,
                    problems: Sequence[Problem], *, samples: int, temperature: float,
                    limits: RolloutLimits, fmt: chat.ChatFormat,
                    seed: int = 0) -> tuple[EvalReport, list[SampleRecord]]:
    """`evaluate` with the runtime's sampler for this model, limits and temperature, and its
    verifier; reports pass@1 and pass@`samples`."""
    sampler = runtime.sampler(model_config, tokenizer, limits,
                              SamplingParams(temperature=temperature), fmt)
    return evaluate(sampler, params, runtime.verifier, problems, samples=samples, fmt=fmt,
                    ks=sorted({1, samples}), seed=seed)


def run_eval(config: EvalConfig) -> tuple[EvalReport, list[SampleRecord]]:
    """`evaluate` with the policy (a Hugging Face directory), data and limits of an `EvalConfig`."""
    from rstar2_jax.data.datasets import load_problems
    from rstar2_jax.model import load_hf

    fmt = chat.get_format(config.model.chat_format)
    tokenizer = open_tokenizer(config.model.path, config.model.tokenizer_path, fmt)
    problems = load_problems(config.dataset)[: config.limit]
    model_config, params = load_hf(config.model.path)
    with RolloutRuntime(config.rollout) as runtime:
        return sample_problems(
            runtime, model_config, params, tokenizer, problems, samples=config.samples,
            temperature=config.temperature, limits=config.limits, fmt=fmt, seed=config.seed)


def run_hard_subset(config: RLJobConfig) -> tuple[int, int]:
    """Builds a stage's hard subset (paper §4.3): `hard_subset.samples` rollouts per problem of
    `hard_subset.source` with the policy the stage starts from (the newest checkpoint of
    `stage.init_from`, else `model.path`), at the stage's limits and the RL temperature; the
    problems not solved every time are written to `hard_subset.output`.

    Returns (problems kept, problems sampled).
    """
    from rstar2_jax.data.datasets import load_problems, save_problems
    from rstar2_jax.model import load_hf
    from rstar2_jax.train.checkpoint import restore_params

    if config.hard_subset is None:
        raise ConfigError("the config has no hard_subset section (source, output, samples)")
    fmt = chat.get_format(config.model.chat_format)
    tokenizer = open_tokenizer(config.model.path, config.model.tokenizer_path, fmt)
    problems = load_problems(config.hard_subset.source)
    if config.stage.init_from is None:
        model_config, params = load_hf(config.model.path)
    else:
        restored = restore_params(f"{config.stage.init_from}/checkpoints")
        model_config, params = restored.model_config, restored.state.params
    with RolloutRuntime(config.rollout) as runtime:
        _, records = sample_problems(
            runtime, model_config, params, tokenizer, problems,
            samples=config.hard_subset.samples, temperature=config.rl.temperature,
            limits=config.limits, fmt=fmt, seed=config.seed)
    kept = hard_subset(problems, records)
    if jax.process_index() == 0:  # every process has every record
        save_problems(config.hard_subset.output, kept)
    return len(kept), len(problems)


def hard_subset(problems: Sequence[Problem], records: Sequence[SampleRecord]) -> list[Problem]:
    """The problems not solved by every one of their samples (paper §4.3, stage 3 data)."""
    solved: dict[int, list[float]] = {}
    for r in records:
        solved.setdefault(r.problem, []).append(r.reward)
    return [p for i, p in enumerate(problems) if not all(solved.get(i, [0.0]))]


def write_samples(path: str | os.PathLike, records: Sequence[SampleRecord]) -> None:
    """One JSON object per sample."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(dataclasses.asdict(r)) + "\n")
