"""SFT inputs for tests: tool-using conversations, and a tiny random Qwen3 checkpoint with a toy
tokenizer trained on them."""
import json

import jax

from rstar2_jax import chat
from rstar2_jax.model import ModelConfig, init_params, save_hf
from rstar2_jax.toy import TOY_FORMAT
from rstar2_jax.toy.tokenizer import build_tokenizer


def conversation(i):
    return [{"role": "user", "content": f"What is {i} plus {i + 1}?"},
            {"role": "assistant", "content": chat.format_tool_call(f"print({i} + {i + 1})")},
            {"role": "tool", "content": str(2 * i + 1)},
            {"role": "assistant", "content": f"</reason><answer>\\boxed{{{2 * i + 1}}}</answer>"}]


def write_sft_setup(d, conversations=8):
    """Writes `d/sft.jsonl` (`conversations` rows) and the checkpoint `d/model` (toy chat
    format); returns (tokenizer, model config)."""
    rows = [conversation(i) for i in range(conversations)]
    (d / "sft.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in rows))
    corpus = [TOY_FORMAT.prompt_text(c[0]["content"]) for c in rows]
    corpus += [m["content"] for c in rows for m in c[1:]]
    tokenizer = build_tokenizer(corpus, vocab_size=300)
    config = ModelConfig(model_type="qwen3", vocab_size=len(tokenizer), hidden_size=32,
                         intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=8, qk_norm=True)
    save_hf(d / "model", config, init_params(config, jax.random.key(0)))
    tokenizer.save_pretrained(d / "model")
    return tokenizer, config
