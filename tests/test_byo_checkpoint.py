"""Bring your own checkpoint, end to end through the CLI: a random Qwen3 checkpoint as Qwen
publishes them (151,936 embedding rows, bf16 shards with an index, a generation config, a
Qwen3-layout tokenizer with a chat template) goes through sft -> export -> rl (model.path =
the export, nothing else set) -> eval -> hard-subset, each a fresh `python -m rstar2_jax`.

About 95 s of CPU in all, a third of it five imports of jax and transformers (226 s wall on the
shared 2-core machine at load 10)."""
import json
import subprocess
import sys

import pytest
import torch
import transformers

from helpers_qwen_tokenizer import QWEN3_EMBEDDING_ROWS, qwen3_style_tokenizer
from rstar2_jax import chat
from rstar2_jax.data.datasets import Problem, load_problems, save_problems

PROBLEMS = [Problem(f"What is {a} + {b}?", str(a + b)) for a, b in ((2, 3), (7, 5), (11, 4))]
CONVERSATIONS = [
    [{"role": "user", "content": PROBLEMS[0].question},
     {"role": "assistant", "content": "I will compute it.</reason>", "tool_calls": [
         {"type": "function", "function": {"name": chat.TOOL_NAME,
                                           "arguments": json.dumps({"code": "print(2 + 3)", "input": ""})}}]},
     {"role": "tool", "content": "Tool call success\nstdout: 5"},
     {"role": "assistant", "content": "It printed 5.</reason><answer>\\boxed{5}</answer>"}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello!"},
     {"role": "user", "content": "Again."}, {"role": "assistant", "content": "Hello again!"}],
]
ROLLOUT = ["rollout.num_slots=2", "rollout.sandbox_workers=1", "rollout.chunk=8"]


def _cli(*args):
    proc = subprocess.run([sys.executable, "-m", "rstar2_jax", *map(str, args)], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("byo")
    corpus = [chat.ChatFormat().prompt_text(p.question) for p in PROBLEMS] + [json.dumps(CONVERSATIONS)]
    tokenizer = qwen3_style_tokenizer(d / "Qwen3-tiny", corpus * 3, merges=800)
    config = transformers.Qwen3Config(
        vocab_size=QWEN3_EMBEDDING_ROWS, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, tie_word_embeddings=True,
        max_position_embeddings=2048, bos_token_id=151643, eos_token_id=151645)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(d / "Qwen3-tiny", max_shard_size="2MB")
    (d / "Qwen3-tiny" / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
         "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}))
    save_problems(d / "problems.jsonl", PROBLEMS)
    (d / "sft.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    assert len(tokenizer) == 151_669
    assert (d / "Qwen3-tiny" / "model.safetensors.index.json").exists()
    return d


# Minutes of end-to-end processes: the slow tier (`python -m pytest -m slow`), not CI.
@pytest.mark.slow
def test_sft_export_rl_eval_hard_subset(base):
    d = base
    out = _cli("sft", f"model.path={d}/Qwen3-tiny", f"data={d}/sft.jsonl", f"run_dir={d}/sft",
               "seq_len=448", "batch_size=2", "epochs=1", "mesh.fsdp=1")
    assert "SFT finished at step 1" in out

    _cli("export", f"{d}/sft/checkpoints", f"{d}/sft_hf")
    exported = {p.name for p in (d / "sft_hf").iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "chat_template.jinja"} <= exported

    stage = ["stage.name=stage1", "stage.steps=1", f"stage.dataset={d}/problems.jsonl",
             "stage.max_turns=2", "stage.max_response_tokens=16", "rl.questions_per_step=2",
             "rl.rollouts_per_question=4", "rl.group_size=2", "rl.max_prompt_tokens=512", "mesh.fsdp=1"]
    out = _cli("rl", f"model.path={d}/sft_hf", f"run_dir={d}/rl", *stage, *ROLLOUT)
    assert "RL finished at step 1" in out
    assert (d / "rl" / "checkpoints" / "1").is_dir() and (d / "rl" / "metrics.jsonl").exists()

    out = _cli("eval", f"model.path={d}/sft_hf", f"dataset={d}/problems.jsonl",
               f"output={d}/eval/samples.jsonl", "samples=2", "max_turns=2", "max_response_tokens=16",
               "max_prompt_tokens=512", *ROLLOUT)
    assert "3 problems x 2 samples" in out
    assert len((d / "eval" / "samples.jsonl").read_text().splitlines()) == 6

    _cli("hard-subset", f"model.path={d}/sft_hf", f"run_dir={d}/stage3", *stage,
         f"stage.init_from={d}/rl", f"hard_subset.source={d}/problems.jsonl",
         f"hard_subset.output={d}/hard.jsonl", "hard_subset.samples=2", *ROLLOUT)
    assert load_problems(d / "hard.jsonl") == PROBLEMS  # a random policy solves nothing
