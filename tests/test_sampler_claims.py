"""Prompts taken from a claim (a queue shared with other hosts) as rows free up draw what the
whole batch in order draws: the same tokens and sampler log-probs, whatever the claim order."""
import dataclasses
import json

import pytest

from claims_setup import SAMPLES, drawn, make_setup
from rstar2_jax.sampler import ToolCallRecord, Trajectory


@pytest.fixture(scope="module")
def setup():
    return make_setup()


def _claims(order):
    it = iter(order)
    return lambda: next(it, None)


def test_any_claim_order_draws_what_the_batch_draws_in_order(setup):
    sampler, params, prompts = setup
    whole, _ = sampler.rollout(params, prompts, SAMPLES, seed=11)
    assert len({tuple(t.response_ids) for t in whole}) > 1  # sampled, not one fixed reply
    assert [(t.prompt_index, t.sample_index) for t in whole] == [
        (p, s) for p in range(6) for s in range(SAMPLES)]
    reverse, _ = sampler.rollout(params, prompts, SAMPLES, seed=11,
                                 claim=_claims([5, 4, 3, 2, 1, 0]))
    assert drawn(reverse) == drawn(whole)
    # Two hosts sharing the queue: each rolls out what it drew, the union is the batch.
    first, _ = sampler.rollout(params, prompts, SAMPLES, seed=11, claim=_claims([3, 0, 5]))
    second, _ = sampler.rollout(params, prompts, SAMPLES, seed=11, claim=_claims([1, 4, 2]))
    assert sorted({t.prompt_index for t in first}) == [0, 3, 5]
    assert drawn(first) | drawn(second) == drawn(whole)
    other_seed, _ = sampler.rollout(params, prompts, SAMPLES, seed=12, claim=_claims([3, 0, 5]))
    assert drawn(other_seed) != drawn(first)


def test_a_prompt_claimed_twice_or_out_of_range_is_an_error(setup):
    sampler, params, prompts = setup
    for order in ([1, 1], [6]):
        with pytest.raises(ValueError, match="claimed prompt"):
            sampler.rollout(params, prompts, 2, claim=_claims(order))


def test_a_trajectory_survives_its_record(setup):
    sampler, params, prompts = setup
    trajs, _ = sampler.rollout(params, prompts[:2], 2, seed=3)
    trajs[0] = dataclasses.replace(trajs[0], tool_calls=[ToolCallRecord("print(1)", "", "ok", "1", 0)])
    assert [Trajectory.from_record(json.loads(json.dumps(t.record()))) for t in trajs] == trajs
