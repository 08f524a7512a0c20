"""RL inputs for tests: a synthetic task with answers 1 or 2, and a tiny Qwen3 (toy tokenizer)
briefly fine-tuned to half guess them, so rewards differ within groups and there is a gradient."""
import json
import os
import shutil

import jax
from filelock import FileLock

from rstar2_jax import chat
from rstar2_jax.config import load_config
from rstar2_jax.data.datasets import Problem, save_problems
from rstar2_jax.model import ModelConfig, init_params, save_hf
from rstar2_jax.toy import TOY_FORMAT
from rstar2_jax.toy.tokenizer import build_tokenizer
from rstar2_jax.train.configs import SFTConfig
from rstar2_jax.train.sft import run_sft

PROBLEMS = [Problem(f"Pick the number for case {i}.", str(1 + i % 2)) for i in range(16)]


def _conversation(p: Problem, tool: bool):
    answer = [{"role": "assistant", "content": f"</reason><answer>\\boxed{{{p.answer}}}</answer>"}]
    if not tool:
        return [{"role": "user", "content": p.question}] + answer
    return [{"role": "user", "content": p.question},
            {"role": "assistant", "content": chat.format_tool_call(f"print({p.answer})")},
            {"role": "tool", "content": f"Tool call success\nstdout: {p.answer}"}] + answer


def rl_overrides(d, run, steps, *overrides):
    """``key=value`` settings of an RL stage on this task in ``d`` (as `write_rl_setup` wrote
    it): 4 questions x 8 rollouts per step, G = 4, the real sandbox and verifier; run directory
    ``d/run``. ``overrides`` come last and win."""
    return [f"model.path={d}/sft_model", "model.chat_format=toy", f"run_dir={d}/{run}",
            f"stage.dataset={d}/train.jsonl", "stage.name=test", f"stage.steps={steps}",
            "stage.max_response_tokens=160", "stage.max_turns=2", "rl.questions_per_step=4",
            "rl.rollouts_per_question=8", "rl.group_size=4", "rl.max_prompt_tokens=128",
            "optimizer.lr=1e-3", "optimizer.warmup_steps=0", "rollout.num_slots=8",
            "rollout.chunk=16", "rollout.show_tool_time=false", "rollout.sandbox_workers=1",
            "rollout.sandbox.timeout_s=30", "rollout.verifier_timeout_s=30", "checkpoint.every=1", *overrides]


def write_rl_setup(d):
    """Writes the problems `d/train.jsonl` and the fine-tuned checkpoint `d/sft_model` (toy chat
    format; one device, 40 epochs of 16 conversations)."""
    conversations = [_conversation(p, tool=i % 2 == 0) for i, p in enumerate(PROBLEMS)]
    with open(d / "sft.jsonl", "w") as f:
        for c in conversations:
            f.write(json.dumps({"messages": c}) + "\n")
    save_problems(d / "train.jsonl", PROBLEMS)
    corpus = [TOY_FORMAT.prompt_text(p.question) for p in PROBLEMS]
    corpus += [m["content"] for c in conversations for m in c[1:]]
    tokenizer = build_tokenizer(corpus * 4, vocab_size=600)
    config = ModelConfig(model_type="qwen3", vocab_size=len(tokenizer), hidden_size=32,
                         intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=8, qk_norm=True, tie_embeddings=True)
    save_hf(d / "init", config, init_params(config, jax.random.key(0)))
    tokenizer.save_pretrained(d / "init")
    state = run_sft(load_config(SFTConfig, overrides=[
        f"model.path={d}/init", "model.chat_format=toy", f"data={d}/sft.jsonl",
        f"run_dir={d}/sft", "seq_len=256", "batch_size=8", "epochs=40", "optimizer.lr=1e-2",
        "optimizer.warmup_steps=1", "mesh.fsdp=1"]), progress=False)
    save_hf(d / "sft_model", config, jax.device_get(state.params))
    tokenizer.save_pretrained(d / "sft_model")


def copied_rl_setup(tmp_path_factory, name: str):
    """A new directory ``name`` holding what `write_rl_setup` writes (``train.jsonl``,
    ``sft_model``), for one test module to run in.

    Four modules train on this setup; its SFT run is written once per test session, under a
    lock, and copied, instead of once per module. The pytest-xdist workers of a session share
    the parent of their base temporary directories; a run without xdist has its own."""
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if "PYTEST_XDIST_WORKER" in os.environ else base) / "rl_setup"
    with FileLock(f"{shared}.lock"):
        if not (shared / "sft_model").exists():
            building = shared.with_name("rl_setup.partial")
            shutil.rmtree(building, ignore_errors=True)
            building.mkdir()
            write_rl_setup(building)
            building.rename(shared)  # whole or absent, should a build be interrupted
    d = tmp_path_factory.mktemp(name)
    shutil.copy(shared / "train.jsonl", d)
    shutil.copytree(shared / "sft_model", d / "sft_model")
    return d
