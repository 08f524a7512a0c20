"""Prompts taken from a claim (a queue shared with other hosts) as rows free up draw what the
whole batch in order draws: the same tokens and sampler log-probs, whatever the claim order."""
import jax
import pytest

from rstar2_jax.model import ModelConfig, init_params
from rstar2_jax.sampler import AgentSampler, RolloutLimits, RolloutSettings, SamplingParams
from rstar2_jax.toy import TOY_FORMAT
from rstar2_jax.toy.tokenizer import build_tokenizer


class NoTools:
    def submit(self, code, stdin=""):
        raise AssertionError("a tool call ran")


@pytest.fixture(scope="module")
def setup():
    questions = [f"What is {a} + {b}?" + " Think." * a for a, b in
                 [(1, 2), (7, 3), (2, 9), (5, 5), (0, 4), (3, 8)]]
    tokenizer = build_tokenizer([TOY_FORMAT.prompt_text(q) for q in questions] * 5, vocab_size=300)
    config = ModelConfig(model_type="qwen3", vocab_size=len(tokenizer), hidden_size=32,
                         intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=8, qk_norm=True)
    # 3 slots, 3 rows: 3 samples of 6 prompts take several waves, rows refilled as they free.
    sampler = AgentSampler(config, tokenizer, NoTools(),
                           RolloutSettings(num_slots=3, num_rows=3, chunk=8, show_tool_time=False),
                           RolloutLimits(max_turns=1, max_response_tokens=40, max_prompt_tokens=128),
                           SamplingParams(temperature=1.0), fmt=TOY_FORMAT)
    prompts = [tokenizer.encode(TOY_FORMAT.prompt_text(q), add_special_tokens=False)
               for q in questions]
    return sampler, init_params(config, jax.random.key(0)), prompts


def _claims(order):
    it = iter(order)
    return lambda: next(it, None)


def _drawn(trajs):
    return {(t.prompt_index, t.sample_index): (t.response_ids, t.logprobs) for t in trajs}


def test_any_claim_order_draws_what_the_batch_draws_in_order(setup):
    sampler, params, prompts = setup
    whole, _ = sampler.rollout(params, prompts, 3, seed=11)
    assert len({tuple(t.response_ids) for t in whole}) > 1  # sampled, not one fixed reply
    assert [(t.prompt_index, t.sample_index) for t in whole] == [
        (p, s) for p in range(6) for s in range(3)]
    reverse, _ = sampler.rollout(params, prompts, 3, seed=11, claim=_claims([5, 4, 3, 2, 1, 0]))
    assert _drawn(reverse) == _drawn(whole)
    # Two hosts sharing the queue: each rolls out what it drew, the union is the batch.
    first, _ = sampler.rollout(params, prompts, 3, seed=11, claim=_claims([3, 0, 5]))
    second, _ = sampler.rollout(params, prompts, 3, seed=11, claim=_claims([1, 4, 2]))
    assert sorted({t.prompt_index for t in first}) == [0, 3, 5]
    assert _drawn(first) | _drawn(second) == _drawn(whole)
    other_seed, _ = sampler.rollout(params, prompts, 3, seed=12, claim=_claims([3, 0, 5]))
    assert _drawn(other_seed) != _drawn(first)


def test_a_prompt_claimed_twice_or_out_of_range_is_an_error(setup):
    sampler, params, prompts = setup
    for order in ([1, 1], [6]):
        with pytest.raises(ValueError, match="claimed prompt"):
            sampler.rollout(params, prompts, 2, claim=_claims(order))
