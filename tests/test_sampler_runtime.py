"""RolloutRuntime: one entered object serves the pools and the samplers of a run."""
import pytest

from rstar2_jax.config import ConfigError, load_config
from rstar2_jax.model import ModelConfig
from rstar2_jax.sampler.runtime import RolloutRuntime
from rstar2_jax.sampler import RolloutLimits, RolloutSettings, SamplingParams
from rstar2_jax.sandbox import SandboxConfig
from rstar2_jax.train.configs import ModelSource, RLJobConfig, StageConfig
from rstar2_jax.rl.loop import run_rl

SETTINGS = RolloutSettings(num_slots=2, sandbox_workers=1, sandbox=SandboxConfig(timeout_s=30.0),
                           verifier_timeout_s=30.0)
MODEL = ModelConfig(model_type="qwen3", vocab_size=16, hidden_size=8, intermediate_size=8,
                    num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8)
LIMITS = RolloutLimits(max_turns=2, max_response_tokens=32, max_prompt_tokens=16)


class Tokenizer:
    """What the sampler reads from a tokenizer when it is built."""

    eos_token_id = None

    def convert_tokens_to_ids(self, token):
        return 1


def test_runtime_runs_tools_and_scores_answers_while_entered():
    runtime = RolloutRuntime(SETTINGS)
    with pytest.raises(RuntimeError, match="enter the RolloutRuntime"):
        runtime.sandbox
    with runtime:
        assert runtime.sandbox.submit("print(6 * 7)", "").result().stdout == "42\n"
        assert runtime.verifier.submit("<answer>\\boxed{42}</answer>", "42").result() == 1.0
        with pytest.raises(RuntimeError, match="already running"):
            runtime.__enter__()
    with pytest.raises(RuntimeError, match="enter the RolloutRuntime"):
        runtime.verifier


def test_one_sampler_per_model_tokenizer_limits_and_sampling():
    tokenizer = Tokenizer()
    with RolloutRuntime(SETTINGS) as runtime:
        sampler = runtime.sampler(MODEL, tokenizer, LIMITS, SamplingParams(temperature=0.6))
        assert sampler.executor is runtime.sandbox and sampler.settings is SETTINGS
        assert (sampler.limits, sampler.sampling) == (LIMITS, SamplingParams(temperature=0.6))
        assert runtime.sampler(MODEL, tokenizer, LIMITS, SamplingParams(temperature=0.6)) is sampler
        others = [runtime.sampler(MODEL, tokenizer, LIMITS, SamplingParams(temperature=1.0)),
                  runtime.sampler(MODEL, Tokenizer(), LIMITS, SamplingParams(temperature=0.6)),
                  runtime.sampler(MODEL, tokenizer, RolloutLimits(3, 32, 16),
                                  SamplingParams(temperature=0.6))]
        assert all(other is not sampler for other in others)


def test_rl_refuses_a_runtime_with_other_settings():
    config = RLJobConfig(model=ModelSource(path="/nonexistent"), run_dir="/nonexistent",
                         stage=StageConfig(name="s", steps=1, dataset="/nonexistent.jsonl"))
    with pytest.raises(ValueError, match="not the config's rollout settings"):
        run_rl(config, runtime=RolloutRuntime(SETTINGS))


def test_a_job_config_sets_the_sandbox_limits():
    settings = load_config(RolloutSettings, overrides=[
        "num_slots=2", "sandbox_workers=1", "sandbox.timeout_s=30", "sandbox.output_limit_bytes=4096",
        "sandbox.max_processes=8", "sandbox.slots_per_worker=2", "sandbox.isolation=none"])
    assert settings.sandbox == SandboxConfig(timeout_s=30.0, output_limit_bytes=4096, max_processes=8,
                                             slots_per_worker=2, isolation="none")
    with RolloutRuntime(settings) as runtime:
        assert runtime.sandbox.submit("print('x' * 10000)", "").result().status == "output_limit"
        assert runtime.sandbox.submit("print('x' * 1000)", "").result().status == "ok"
        # Every limit of the section reaches the pool, the ones only a config sets included.
        assert (runtime.sandbox.config.slots_per_worker, runtime.sandbox.level) == (2, "none")
    with pytest.raises(ConfigError, match="max_open_files below 16"):
        load_config(RolloutSettings, overrides=["sandbox.max_open_files=8"])
    with pytest.raises(ConfigError, match="memory_bytes must be a positive integer"):
        load_config(RolloutSettings, overrides=["sandbox.memory_bytes=0"])


def test_a_job_config_sets_the_pool_memory_bound():
    settings = load_config(RolloutSettings, overrides=[
        "sandbox_workers=2", f"sandbox.pool_memory_bytes={2 * 2**30}"])
    with RolloutRuntime(settings) as runtime:
        assert runtime.sandbox.config.pool_memory_bytes == 2 * 2**30
    # Two templates cannot each hold one call of 1 GiB (the default memory_bytes) in 1 GiB.
    with pytest.raises(ConfigError, match="rollout.sandbox: pool_memory_bytes .* must leave each of the 2 templates"):
        load_config(RolloutSettings, overrides=["sandbox_workers=2", f"sandbox.pool_memory_bytes={2**30}"])
