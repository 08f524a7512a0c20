"""The RL loop end to end: a tiny model, the real sandbox and verifier, a few GRPO-RoC steps,
a stopped-then-resumed run that repeats the uninterrupted one, one step each with an advantage
estimator and a policy loss written here, outside the package, and the entropy bonus and KL
penalty to the reference, written by a user (tests/user_algorithms.py) or set as options."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_setup import PROBLEMS, copied_rl_setup, rl_overrides
from user_algorithms import ENTROPY_GRPO
from rstar2_jax import chat
from rstar2_jax.algorithms import GRPO, GRPO_ROC, Rollouts
from rstar2_jax.config import load_config
from rstar2_jax.model import load_hf
from rstar2_jax.rewards import VerifierPool
from rstar2_jax.sampler import AgentSampler, RolloutLimits, RolloutSettings, SamplingParams
from rstar2_jax.sandbox import SandboxPool
from rstar2_jax.tokenizer import open_tokenizer
from rstar2_jax.toy import TOY_FORMAT
from rstar2_jax.train.configs import RLJobConfig
from rstar2_jax.train.metrics import read_metrics
from rstar2_jax.rl.data import question_batch
from rstar2_jax.rl.loop import run_rl


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory):
    return copied_rl_setup(tmp_path_factory, "rl")


def _rl_config(d, run, steps, *overrides):
    return load_config(RLJobConfig, overrides=rl_overrides(
        d, run, steps, "rl.mini_batches=2", "mesh.fsdp=1", *overrides))


# Every step logs these; the tool-error ratios are logged when there is something to measure.
METRICS = {
    "reward/mean", "reward/question_accuracy", "groups/kept", "tools/calls_per_rollout",
    "roc/format_penalty_mean",
    "response/length_mean", "response/length_max", "response/truncated", "clip_low_frac",
    "clip_high_frac", "approx_kl", "entropy", "grad_norm", "lr", "logprob_mismatch/abs",
    "perf/rollout_tokens_per_s", "perf/update_tokens_per_s", "time/rollout_s",
    "time/tool_wait_s", "time/reward_wait_s", "time/update_s", "loss", "rollouts/positives",
    "rollouts/kept_positives", "rollouts/preemptions", "reward/verifier_timeouts",
    "reward/verifier_errors",
}


def test_rl_steps_train_and_resume_exactly(sft_model):
    d = sft_model
    _, before = load_hf(d / "sft_model")
    full = run_rl(_rl_config(d, "full", 2), progress=False)
    records = read_metrics(d / "full")
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert METRICS <= r.keys(), METRICS - r.keys()
        assert np.isfinite(r["loss"]) and r["groups/kept"] >= 1
        assert r["rollouts/preemptions"] == 0  # no memory budget on CPU: every row fits
        assert 0.0 < r["reward/mean"] < 1.0
        assert r["rollouts/positives"] == r["reward/mean"] * 4 * 8  # questions x rollouts
        assert ("tools/error_ratio_kept_positives" in r) <= (r["rollouts/kept_positives"] > 0)
        shares = [v for k, v in r.items() if k.startswith("tools/share/")]
        assert r["tools/calls_per_rollout"] > 0 and sum(shares) == pytest.approx(1.0)
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


def test_packed_rl_steps_train_as_padded_ones(sft_model):
    # rl.packed: the same rollouts, metrics and params as padded rows, with the update's
    # rollout layout at the most rows a step can keep, so its shapes vary with the packed row
    # count only. Adam divides each gradient entry by its own size, so rounding-level
    # differences in near-zero entries become lr-sized updates (1e-4 here) with the default
    # eps of 1e-8; an eps of 1e-4 keeps such entries' updates proportional to them. One
    # mini-batch, for the same reason (tests/test_rl_update.py compares packed mini- and
    # micro-batches update by update).
    d = sft_model
    same = ("rl.mini_batches=1", "optimizer.eps=1e-4")
    padded = run_rl(_rl_config(d, "padded_one_mini", 2, *same, "rl.packed=false"), progress=False)
    packed = run_rl(_rl_config(d, "packed", 2, *same, "rl.packed=true"), progress=False)
    for a, b in zip(read_metrics(d / "padded_one_mini"), read_metrics(d / "packed"), strict=True):
        same = {k for k in a if not k.startswith(("time/", "perf/"))}
        assert {k: b[k] for k in same} == pytest.approx({k: a[k] for k in same}, rel=1e-5, abs=1e-6)
        assert a["groups/kept"] >= 1
    for a, b in zip(jax.tree.leaves(padded.params), jax.tree.leaves(packed.params), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5, rtol=0)


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


def test_an_entropy_bonus_from_user_code_trains_one_step(sft_model):
    d = sft_model
    _, before = load_hf(d / "sft_model")
    state = run_rl(_rl_config(d, "entropy", 1, "rl.mini_batches=1"), algorithm=ENTROPY_GRPO,
                   progress=False)
    [record] = read_metrics(d / "entropy")
    # One update on policy: the entropy the loss saw (from its own forward, with a gradient) is
    # the policy's entropy the step logs (from the old log-prob pass), token mean.
    assert record["mine/entropy"] == pytest.approx(record["entropy"], rel=1e-4)
    assert record["entropy"] > 0 and record["tokens"] > 0
    assert _moved(before, state.params) > 1e-4


def test_a_kl_penalty_from_user_code_trains_against_the_reference_and_resumes_exactly(sft_model):
    d = sft_model
    _, before = load_hf(d / "sft_model")
    kl = ("rl.algorithm=user_algorithms:KL_GRPO", "rl.reference=true")
    full = run_rl(_rl_config(d, "kl", 2, *kl), progress=False)
    first, second = read_metrics(d / "kl")
    # The reference is the stage's initial weights: no KL before the first update, some after.
    assert first["ref_kl"] == 0.0
    assert second["ref_kl"] > 1e-6
    assert first["mine/kl"] > 0  # the second mini-batch of step 1 sees a moved policy
    assert _moved(before, full.params) > 1e-4
    # A resumed run reads the reference again from model.path: the same steps.
    run_rl(_rl_config(d, "kl_resumed", 1, *kl), progress=False)
    resumed = run_rl(_rl_config(d, "kl_resumed", 2, *kl), progress=False)
    for a, b in zip(jax.tree.leaves(full.params), jax.tree.leaves(resumed.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0)
    assert read_metrics(d / "kl_resumed")[1]["ref_kl"] == pytest.approx(second["ref_kl"], rel=1e-5)


def test_the_entropy_bonus_and_kl_penalty_options_train_a_named_algorithm(sft_model):
    d = sft_model
    run_rl(_rl_config(d, "options", 1, "rl.mini_batches=1", "rl.entropy_coef=0.01",
                      "rl.kl_coef=0.1", "rl.kl_penalty=k2", "rl.reference=true"), progress=False)
    [record] = read_metrics(d / "options")
    assert record["entropy_loss"] == pytest.approx(record["entropy"], rel=1e-4)
    assert record["kl_loss"] == 0.0 == record["ref_kl"]  # one update, from the reference itself


def test_a_share_of_the_questions_draws_what_it_draws_in_the_whole_step(sft_model):
    # What one host of several rolls out: questions 2 and 3 of 4, started at their offset in
    # the step, sample the tokens they get when one host rolls out all 4.
    d = sft_model
    config, params = load_hf(d / "sft_model")
    tokenizer = open_tokenizer(d / "sft_model", d / "sft_model", TOY_FORMAT)
    prompts = [chat.encode_prompt(tokenizer, p.question, TOY_FORMAT) for p in PROBLEMS[:4]]
    with SandboxPool(num_workers=1, timeout_s=30.0) as pool:
        sampler = AgentSampler(config, tokenizer, pool,
                               RolloutSettings(num_slots=8, chunk=16, show_tool_time=False),
                               RolloutLimits(max_turns=2, max_response_tokens=64, max_prompt_tokens=128),
                               SamplingParams(temperature=1.0), fmt=TOY_FORMAT)
        whole, _ = sampler.rollout(params, prompts, 4, seed=7)
        share, _ = sampler.rollout(params, prompts[2:], 4, seed=7, first_sequence=8)
        unshifted, _ = sampler.rollout(params, prompts[2:], 4, seed=7)
    assert [t.response_ids for t in share] == [t.response_ids for t in whole[8:]]
    assert [t.response_ids for t in unshifted] != [t.response_ids for t in whole[8:]]


def test_verifications_that_time_out_are_counted_in_the_step_metrics(sft_model, monkeypatch):
    """A verification past its deadline scores 0; the step says how many did, so a loaded
    verifier pool is not mistaken for a policy that stopped solving. Here every check times
    out, as the pool handles one (counted, scored 0), without waiting for a real deadline."""
    def times_out(pool, slot, response_text, gold, future):
        pool._count("timeouts")
        future.set_result(0.0)

    monkeypatch.setattr(VerifierPool, "_score", times_out)
    d = sft_model
    run_rl(_rl_config(d, "verifier_timeouts", 1), progress=False)
    [r] = read_metrics(d / "verifier_timeouts")
    assert r["reward/mean"] == 0.0 and r["groups/kept"] == 0
    # Every rollout that was not cut at the token budget went to the verifier.
    assert r["reward/verifier_timeouts"] == round(4 * 8 * (1 - r["response/truncated"])) > 0
    assert r["reward/verifier_errors"] == 0


def test_question_batches_cover_each_epoch_once():
    steps = [question_batch(10, 3, s, seed=1) for s in range(6)]
    epoch0, epoch1 = np.concatenate(steps[:3]), np.concatenate(steps[3:])
    assert len(set(epoch0)) == 9 and len(set(epoch1)) == 9
    assert not np.array_equal(epoch0, epoch1)
    with pytest.raises(ValueError):
        question_batch(2, 3, 0, seed=0)


def test_bfloat16_compute_keeps_the_sampler_trainer_gap_small(sft_model):
    """Under bfloat16 compute (float32 master weights) the sampler serves bfloat16 and the
    trainer recomputes in bfloat16: the log-prob gap it logs stays small, and the master
    weights stay float32."""
    d = sft_model
    state = run_rl(_rl_config(d, "bf16", 1, "rl.mini_batches=1", "precision.compute=bfloat16"),
                   progress=False)
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}
    [bf16] = read_metrics(d / "bf16")
    run_rl(_rl_config(d, "fp32", 1, "rl.mini_batches=1"), progress=False)
    [fp32] = read_metrics(d / "fp32")
    assert fp32["logprob_mismatch/abs"] < 1e-4  # the same numerics but for summation order
    # Measured: 2.1e-3 nats/token and a KL of 2e-5 (float32: 2.5e-7 and 0); bfloat16 keeps ~3
    # significant digits, so a gap above 1e-5 shows that both sides did compute in bfloat16.
    assert 1e-5 < bf16["logprob_mismatch/abs"] < 2e-2
    assert bf16["logprob_mismatch/kl"] < 5e-4
    assert np.isfinite(bf16["loss"]) and bf16["tokens"] > 0
