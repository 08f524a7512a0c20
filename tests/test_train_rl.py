"""The RL loop end to end: a tiny model, the real sandbox and verifier, a few GRPO-RoC steps,
a stopped-then-resumed run that repeats the uninterrupted one, and one step each with an
advantage estimator and a policy loss written here, outside the package."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstar2_jax import chat
from rstar2_jax.algorithms import GRPO, GRPO_ROC, Rollouts
from rstar2_jax.config import load_config
from rstar2_jax.data.datasets import Problem, save_problems
from rstar2_jax.model import ModelConfig, init_params, save_hf
from rstar2_jax.toy import TOY_FORMAT
from rstar2_jax.toy.tokenizer import build_tokenizer
from rstar2_jax.train.configs import RLJobConfig, SFTConfig
from rstar2_jax.train.metrics import read_metrics
from rstar2_jax.train.rl import question_batch, run_rl
from rstar2_jax.train.sft import run_sft

# A synthetic task with answers 1 or 2 that a briefly fine-tuned tiny model half guesses:
# rewards differ within groups, so there is a gradient.
PROBLEMS = [Problem(f"Pick the number for case {i}.", str(1 + i % 2)) for i in range(16)]


def _conversation(p: Problem, tool: bool):
    answer = [{"role": "assistant", "content": f"</reason><answer>\\boxed{{{p.answer}}}</answer>"}]
    if not tool:
        return [{"role": "user", "content": p.question}] + answer
    return [{"role": "user", "content": p.question},
            {"role": "assistant", "content": chat.format_tool_call(f"print({p.answer})")},
            {"role": "tool", "content": f"Tool call success\nstdout: {p.answer}"}] + answer


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("rl")
    fmt = TOY_FORMAT
    conversations = [_conversation(p, tool=i % 2 == 0) for i, p in enumerate(PROBLEMS)]
    with open(d / "sft.jsonl", "w") as f:
        for c in conversations:
            f.write(json.dumps({"messages": c}) + "\n")
    save_problems(d / "train.jsonl", PROBLEMS)
    corpus = [fmt.prompt_text(p.question) for p in PROBLEMS]
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
    return d


def _rl_config(d, run, steps, *overrides):
    return load_config(RLJobConfig, overrides=[
        f"model.path={d}/sft_model", "model.chat_format=toy", f"run_dir={d}/{run}",
        f"stage.dataset={d}/train.jsonl", "stage.name=test", f"stage.steps={steps}",
        "stage.max_response_tokens=160", "stage.max_turns=2", "rl.questions_per_step=4",
        "rl.rollouts_per_question=8", "rl.group_size=4", "rl.max_prompt_tokens=128",
        "rl.mini_batches=2", "optimizer.lr=1e-3", "optimizer.warmup_steps=0", "mesh.fsdp=1",
        "rollout.num_slots=8", "rollout.chunk=16", "rollout.show_tool_time=false",
        "rollout.sandbox_workers=1", "rollout.tool_timeout_s=2", "checkpoint.every=1",
        *overrides])


# Every step logs these; the tool-error ratios are logged when there is something to measure.
METRICS = {
    "reward/mean", "reward/question_accuracy", "groups/kept", "tools/calls_per_rollout",
    "roc/format_penalty_mean",
    "response/length_mean", "response/length_max", "response/truncated", "clip_low_frac",
    "clip_high_frac", "approx_kl", "entropy", "grad_norm", "lr", "logprob_mismatch/abs",
    "perf/rollout_tokens_per_s", "perf/update_tokens_per_s", "time/rollout_s",
    "time/tool_wait_s", "time/reward_wait_s", "time/update_s", "loss", "rollouts/positives",
    "rollouts/kept_positives",
}


def test_rl_steps_train_and_resume_exactly(sft_model):
    d = sft_model
    from rstar2_jax.model import load_hf

    _, before = load_hf(d / "sft_model")
    full = run_rl(_rl_config(d, "full", 2), progress=False)
    records = read_metrics(d / "full")
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert METRICS <= r.keys(), METRICS - r.keys()
        assert np.isfinite(r["loss"]) and r["groups/kept"] >= 1
        assert 0.0 < r["reward/mean"] < 1.0
        assert r["rollouts/positives"] == r["reward/mean"] * 4 * 8  # questions x rollouts
        assert ("tools/error_ratio_kept_positives" in r) <= (r["rollouts/kept_positives"] > 0)
    moved = [float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
             for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(jax.device_get(full.params)))]
    assert max(moved) > 1e-4

    # Stop after one step, then resume to two: same params and metrics.
    run_rl(_rl_config(d, "resumed", 1), progress=False)
    resumed = run_rl(_rl_config(d, "resumed", 2), progress=False)
    assert int(resumed.step) == 2
    for a, b in zip(jax.tree.leaves(full.params), jax.tree.leaves(resumed.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0)
    again = read_metrics(d / "resumed")
    for a, b in zip(records, again, strict=True):
        same = {k for k in a if not k.startswith(("time/", "perf/"))}
        assert {k: a[k] for k in same} == pytest.approx({k: b[k] for k in same}, rel=1e-5, abs=1e-6)


# --- the seam: an algorithm written outside the package, passed by value ------------------------

def leave_one_out(kept: Rollouts) -> np.ndarray:
    """RLOO's estimator (Ahmadian et al. 2024): each reward minus the mean of the others."""
    rewards = np.asarray(kept.rewards, np.float64)
    g = rewards.shape[-1]
    ADVANTAGE_CALLS.append((rewards, kept.lengths))
    return (rewards - (rewards.sum(-1, keepdims=True) - rewards) / (g - 1)).astype(np.float32)


ADVANTAGE_CALLS = []


def reinforce(logp, old_logp, advantages, mask):
    """Unclipped REINFORCE, -A * logp summed over tokens, averaged over tokens; one metric."""
    mask = mask.astype(bool)
    per_token = jnp.where(mask, -advantages[:, None] * logp, 0.0)
    mean_logp = jnp.sum(jnp.where(mask, jax.lax.stop_gradient(logp), 0.0))
    return jnp.sum(per_token), jnp.sum(mask).astype(jnp.int32), {"reinforce/logp": mean_logp}


def _moved(before, after) -> float:
    return max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
               for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(jax.device_get(after))))


def test_an_advantage_estimator_from_user_code_trains_one_step(sft_model):
    from rstar2_jax.model import load_hf

    d = sft_model
    _, before = load_hf(d / "sft_model")
    ADVANTAGE_CALLS.clear()
    mine = dataclasses.replace(GRPO_ROC, advantages=leave_one_out)
    state = run_rl(_rl_config(d, "rloo", 1, "rl.mini_batches=1"), algorithm=mine, progress=False)
    # run_rl tries the algorithm on a made-up step first, then the one real step: RoC's kept
    # groups of G = 4.
    assert len(ADVANTAGE_CALLS) == 2
    rewards, lengths = ADVANTAGE_CALLS[-1]
    [record] = read_metrics(d / "rloo")
    assert rewards.shape == lengths.shape == (record["groups/kept"], 4)
    assert record["rollouts/kept"] == rewards.size and record["tokens"] > 0
    assert _moved(before, state.params) > 1e-4


def test_a_policy_loss_from_user_code_trains_one_step(sft_model):
    from rstar2_jax.model import load_hf

    d = sft_model
    _, before = load_hf(d / "sft_model")
    mine = dataclasses.replace(GRPO, loss=reinforce)
    state = run_rl(_rl_config(d, "reinforce", 1, "rl.mini_batches=1"), algorithm=mine, progress=False)
    [record] = read_metrics(d / "reinforce")
    # Its metric, divided by its count (the loss tokens), is the mean log-prob of those tokens.
    assert record["reinforce/logp"] < 0 and record["tokens"] > 0
    assert record["rollouts/kept"] == record["groups/kept"] * 8  # GRPO keeps all 2G
    assert "clip_low_frac" not in record  # GRPO's loss metrics are gone with its loss
    assert _moved(before, state.params) > 1e-4


def test_question_batches_cover_each_epoch_once():
    steps = [question_batch(10, 3, s, seed=1) for s in range(6)]
    epoch0, epoch1 = np.concatenate(steps[:3]), np.concatenate(steps[3:])
    assert len(set(epoch0)) == 9 and len(set(epoch1)) == 9
    assert not np.array_equal(epoch0, epoch1)
    with pytest.raises(ValueError):
        question_batch(2, 3, 0, seed=0)
