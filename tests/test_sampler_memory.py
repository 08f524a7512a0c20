"""The rollout engine's memory plan (checked before the first rollout) and the serving dtype."""
import dataclasses

import jax
import jax.numpy as jnp
import pytest

from rstar2_jax import chat
from rstar2_jax.errors import ConfigError
from rstar2_jax.model import ModelConfig, init_params
from rstar2_jax.sampler import AgentSampler, RolloutLimits, RolloutSettings, SamplingParams
from rstar2_jax.sampler.engine import STAGE_ROWS
from rstar2_jax.sampler.memory import GIB, check_plan, plan_memory
from rstar2_jax.toy import TOY_FORMAT
from rstar2_jax.toy.tokenizer import build_tokenizer

LIMITS = RolloutLimits(max_turns=2, max_response_tokens=96, max_prompt_tokens=128)


class NoTools:
    """An executor that must not be reached."""

    def submit(self, code, stdin=""):
        raise AssertionError("a tool call ran")


@pytest.fixture(scope="module")
def model():
    tokenizer = build_tokenizer([TOY_FORMAT.prompt_text("What is 2 + 2?")] * 5, vocab_size=300)
    config = ModelConfig(model_type="qwen3", vocab_size=len(tokenizer), hidden_size=32,
                         intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=8, qk_norm=True)
    return tokenizer, config, init_params(config, jax.random.key(0))


def _sampler(model, **settings):
    tokenizer, config, _ = model
    settings = RolloutSettings(num_slots=4, chunk=16, show_tool_time=False, **settings)
    return AgentSampler(config, tokenizer, NoTools(), settings, LIMITS,
                        SamplingParams(temperature=1.0), fmt=TOY_FORMAT)


def _plan(model, num_slots=4, budget=None, dtype=None):
    _, config, params = model
    if dtype is not None:
        config = dataclasses.replace(config, dtype=dtype)
    return plan_memory(config, params, num_slots=num_slots,
                       num_rows=RolloutSettings(num_slots=num_slots).rows,
                       max_len=LIMITS.max_prompt_tokens + LIMITS.max_response_tokens,
                       max_prompt_len=LIMITS.max_prompt_tokens, stage_rows=STAGE_ROWS,
                       page_size=RolloutSettings().page_size, budget=budget)


def _least(plan):
    """The smallest budget the plan accepts."""
    return plan.fixed() + plan.least_pages * plan.page_bytes


def _prompts(model, n):
    tokenizer = model[0]
    return [chat.encode_prompt(tokenizer, "What is 2 + 2?", TOY_FORMAT)] * n


def test_a_configuration_over_budget_stops_before_any_rollout(model):
    plan = _plan(model)
    sampler = _sampler(model, memory_budget_gib=(_least(plan) - 1) / GIB)
    with pytest.raises(ConfigError, match=rf"needs at least .* but may use .*smallest page pool, "
                                          rf"{plan.least_pages} pages .*set rollout\.num_slots=3 "):
        sampler.rollout(model[2], _prompts(model, 2), 2)
    assert sampler._engine is None  # nothing was allocated or compiled


def test_an_accepted_plan_completes_and_its_pool_is_the_engines(model):
    plan = _plan(model, budget=_least(_plan(model)))
    assert plan.num_pages == plan.least_pages < plan.full_pages
    sampler = _sampler(model, memory_budget_gib=plan.budget / GIB)
    pools = []

    def inspect(_):
        pools.append(sum(x.nbytes for x in jax.tree.leaves(sampler._engine.pages)))

    # A random policy talks until its token budget: rows grow to their full length, more of
    # them than the pool holds at once.
    trajs, _ = sampler.rollout(model[2], _prompts(model, 2), 4, on_finish=inspect)
    assert len(trajs) == 8 and any(t.truncated for t in trajs)
    assert set(pools) == {plan.pool}
    assert sampler._engine.num_pages == plan.num_pages
    assert sampler._engine.pages is None  # the pool is dropped after the rollout
    params_bytes = sum(x.nbytes for x in jax.tree.leaves(model[2]))
    assert plan.params == params_bytes


def test_the_plan_names_the_largest_slot_count_that_fits(model):
    fits = _least(_plan(model, num_slots=5))
    assert _plan(model, num_slots=64, budget=fits).max_slots() == 5
    check_plan(_plan(model, num_slots=5, budget=fits))
    with pytest.raises(ConfigError, match=r"set rollout\.num_slots=5 or fewer"):
        check_plan(_plan(model, num_slots=6, budget=fits))
    with pytest.raises(ConfigError, match="no slot count fits"):
        check_plan(_plan(model, budget=1))
    check_plan(_plan(model, num_slots=10**6, budget=None))  # no limit known: nothing to check
    # A budget past what every slot at full length needs gives them no more pages than that.
    roomy = _plan(model, budget=100 * _least(_plan(model)))
    assert roomy.num_pages == roomy.full_pages


def test_bfloat16_serving_halves_the_cache_and_casts_the_params(model):
    assert _plan(model, dtype="bfloat16").kv_per_token * 2 == _plan(model).kv_per_token
    sampler = _sampler(model, serving_dtype="bfloat16")
    seen = []

    def inspect(_):
        engine = sampler._engine
        seen.append(({x.dtype for x in jax.tree.leaves(engine.pages)},
                     {x.dtype for x in jax.tree.leaves(engine.params)}))

    trajs, _ = sampler.rollout(model[2], _prompts(model, 1), 2, on_finish=inspect)
    assert len(trajs) == 2 and all(t.response_ids for t in trajs)
    pages, params = zip(*seen)
    # The pools hold the bfloat16 keys and values as their 16 bits (`model.cache.as_bits`).
    assert set(map(frozenset, pages)) == {frozenset({jnp.dtype(jnp.uint16)})}
    assert set(map(frozenset, params)) == {frozenset({jnp.dtype(jnp.bfloat16)})}
    assert {x.dtype for x in jax.tree.leaves(model[2])} == {jnp.dtype(jnp.float32)}  # not in place
    # On CPU "auto" serves the model's own dtype.
    assert RolloutSettings().serving_config(model[1]).dtype == "float32"


def test_preflight_refuses_what_no_device_holds_and_passes_the_rest(model):
    """Issue 51: `preflight` checks a job's engine against a whole device before the job starts
    (on CPU the host's memory): 10**9 slots or a 10**12-token response budget never fit."""
    from rstar2_jax.sampler.memory import preflight

    _, config, _ = model
    plan = preflight(config, RolloutSettings(num_slots=4), LIMITS)
    assert plan.fits and plan.budget > 0
    with pytest.raises(ConfigError, match=r"for 1000000000 slots.*set rollout.num_slots=\d+ or fewer"):
        preflight(config, RolloutSettings(num_slots=10**9), LIMITS)
    huge = dataclasses.replace(LIMITS, max_response_tokens=10**12)
    with pytest.raises(ConfigError, match=r"no slot count fits: lower the longest response"):
        preflight(config, RolloutSettings(num_slots=4), huge)
    with pytest.raises(ConfigError, match=r"may use 1.00 GiB"):  # the budget, when given
        preflight(config, RolloutSettings(num_slots=4, memory_budget_gib=1.0),
                  dataclasses.replace(LIMITS, max_response_tokens=10**7))


def test_on_cpu_the_engine_budget_is_the_hosts_available_memory():
    from rstar2_jax.sampler.memory import _host_memory, device_budget

    assert jax.default_backend() == "cpu"
    budget = device_budget(None, 0.5, {})
    assert 0 < budget <= 0.5 * _host_memory("MemTotal")
    assert device_budget(2.0, 0.5, {}) == 2 * GIB
