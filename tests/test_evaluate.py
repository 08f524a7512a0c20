"""Evaluation: the pass@k estimator and an end-to-end run with a scripted policy."""
import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rstar2_jax import chat
from rstar2_jax.data.datasets import Problem
from rstar2_jax.evaluate import SampleRecord, evaluate, hard_subset, pass_at_k, write_samples
from rstar2_jax.rewards import VerifierPool
from rstar2_jax.sampler import AgentSampler, RolloutLimits, RolloutSettings, SamplingParams
from rstar2_jax.sandbox import SandboxPool
from rstar2_jax.toy.tokenizer import build_tokenizer
from scripted_policy import FORMAT, make_policy


def test_pass_at_k_closed_form():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(4, 3, 2) == 1.0  # any 2 of 4 include one of the 3 correct
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 7).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n),
                                                     st.integers(1, n))))
def test_pass_at_k_equals_enumeration_of_subsets(args):
    n, c, k = args
    outcomes = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(outcomes, k))
    assert pass_at_k(n, c, k) == pytest.approx(np.mean([any(s) for s in subsets]))


def test_evaluate_scores_every_sample(tmp_path):
    tokenizer = build_tokenizer([FORMAT.prompt_text("What is 6*7?"), "answer boxed print"] * 20,
                                vocab_size=400)
    scripts = [
        # right, via the tool
        [chat.format_tool_call("print(6*7)"), "</reason><answer>\\boxed{42}</answer>"],
        # wrong, without the tool
        ["</reason><answer>\\boxed{41}</answer>"],
    ]
    config, params, forward, markers = make_policy(tokenizer, scripts)
    problems = [Problem("What is 6*7?", "42"), Problem("What is 6*7?", "42")]

    class MarkedSampler(AgentSampler):
        # Selects script i for problem i: the scripted policy reads the prompt's first token.
        def rollout(self, params, prompts, samples_per_prompt=1, on_finish=None, seed=0,
                    first_sequence=0, claim=None, version=0, stop=None):
            marked = [[markers[i]] + p for i, p in enumerate(prompts)]
            return super().rollout(params, marked, samples_per_prompt, on_finish, seed,
                                   first_sequence, claim, version, stop)

    with SandboxPool(num_workers=1, timeout_s=30.0) as pool, VerifierPool(num_workers=1, timeout_s=30.0) as verifier:
        sampler = MarkedSampler(config, tokenizer, pool,
                                RolloutSettings(num_slots=4, chunk=16),
                                RolloutLimits(max_turns=10, max_response_tokens=300,
                                              max_prompt_tokens=64),
                                SamplingParams(temperature=0.0), forward_fn=forward)
        report, records = evaluate(sampler, params, verifier, problems, samples=3, fmt=FORMAT,
                                   ks=(1, 3))
    assert report.problems == 2 and report.samples_per_problem == 3
    assert report.pass_at == {1: pytest.approx(0.5), 3: pytest.approx(0.5)}
    assert report.tool_calls_per_sample == pytest.approx(0.5)
    assert report.tool_error_rate == 0.0 and report.truncation_rate == 0.0
    assert [(r.problem, r.reward) for r in records] == [(0, 1.0)] * 3 + [(1, 0.0)] * 3
    write_samples(tmp_path / "samples.jsonl", records)
    lines = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(lines) == 6 and lines[0]["tool_calls"][0]["status"] == "ok"
    # The response the model read (it showed the time: RolloutSettings' default), less its time.
    assert lines[0]["tool_calls"][0]["response"] == "Tool call success\nstdout: 42"


def test_hard_subset_drops_problems_solved_by_every_sample():
    problems = [Problem(f"q{i}", "1") for i in range(3)]

    def record(problem, reward):
        return SampleRecord(problem, 0, "", "", reward, "answer", 1, [], "")

    records = [record(0, 1.0), record(0, 1.0), record(1, 1.0), record(1, 0.0), record(2, 0.0)]
    assert hard_subset(problems, records) == problems[1:]
