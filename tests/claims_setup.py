"""A tiny random Qwen3 sampling at temperature 1 with no tools, and 6 prompts of different
lengths: the rollouts the claim tests (one process and several) compare."""
import jax

from rstar2_jax.model import ModelConfig, init_params
from rstar2_jax.sampler import AgentSampler, RolloutLimits, RolloutSettings, SamplingParams
from rstar2_jax.toy import TOY_FORMAT
from rstar2_jax.toy.tokenizer import build_tokenizer

SAMPLES = 3


class NoTools:
    def submit(self, code, stdin=""):
        raise AssertionError("a tool call ran")


def make_setup():
    """(sampler, params, prompts)."""
    questions = [f"What is {a} + {b}?" + " Think." * a for a, b in
                 [(1, 2), (7, 3), (2, 9), (5, 5), (0, 4), (3, 8)]]
    tokenizer = build_tokenizer([TOY_FORMAT.prompt_text(q) for q in questions] * 5, vocab_size=300)
    config = ModelConfig(model_type="qwen3", vocab_size=len(tokenizer), hidden_size=32,
                         intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=8, qk_norm=True)
    # 3 rows: 3 samples of 6 prompts take several waves, rows refilled as they free.
    sampler = AgentSampler(config, tokenizer, NoTools(),
                           RolloutSettings(num_slots=3, num_rows=3, chunk=8, show_tool_time=False),
                           RolloutLimits(max_turns=1, max_response_tokens=40, max_prompt_tokens=128),
                           SamplingParams(temperature=1.0), fmt=TOY_FORMAT)
    prompts = [tokenizer.encode(TOY_FORMAT.prompt_text(q), add_special_tokens=False)
               for q in questions]
    return sampler, init_params(config, jax.random.key(0)), prompts


def drawn(trajs):
    """(prompt, sample) -> (response ids, sampler log-probs)."""
    return {(t.prompt_index, t.sample_index): (t.response_ids, t.logprobs) for t in trajs}
