"""Every named algorithm trains one toy RL step through the public API (``rl.algorithm=<name>``),
with the sampler serving bfloat16 against the float32 trainer and token-level TIS on; and the
first-step guard stops a run whose sampler draws at another temperature than the trainer
divides by: one line, exit status 2 from the CLI, no update saved."""
import numpy as np
import pytest

from rl_setup import copied_rl_setup, rl_overrides
from rstar2_jax.algorithms import ALGORITHMS
from rstar2_jax.cli import main
from rstar2_jax.config import load_config
from rstar2_jax.model import load_hf
from rstar2_jax.sampler.runtime import RolloutRuntime
from rstar2_jax.sampler import SamplingParams
from rstar2_jax.rl import loop as rl_module
from rstar2_jax.train.configs import RLJobConfig
from rstar2_jax.train.metrics import read_metrics
from rstar2_jax.rl.loop import run_rl

# One step of 2 questions x 8 rollouts (G = 4, the least the released RoC rule takes), short
# responses.
SMALL = ("rl.questions_per_step=2", "stage.max_response_tokens=96", "mesh.fsdp=1")
BF16 = "rollout.serving_dtype=bfloat16"


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory):
    return copied_rl_setup(tmp_path_factory, "rl_algorithms")


@pytest.fixture(scope="module")
def runtime(sft_model):
    config = load_config(RLJobConfig, overrides=rl_overrides(sft_model, "x", 1, *SMALL, BF16))
    with RolloutRuntime(config.rollout) as r:
        yield r


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_named_algorithm_trains_one_step_with_rollout_correction(sft_model, runtime, name):
    d = sft_model
    config = load_config(RLJobConfig, overrides=rl_overrides(
        d, f"run_{name}", 1, *SMALL, BF16, f"rl.algorithm={name}",
        "rl.rollout_correction.weights=token", "rl.rollout_correction.mask=token"))
    state = run_rl(config, runtime=runtime, progress=False)
    [record] = read_metrics(d / f"run_{name}")
    assert record["tokens"] > 0 and np.isfinite(record["loss"]) and np.isfinite(record["grad_norm"])
    # bfloat16 serving against the float32 trainer: a real gap, far below the guard's bound,
    # and weights close to 1, none truncated at 2 or masked outside [0.5, 2].
    assert 0 < record["logprob_mismatch/log_ppl_abs_diff"] < config.rl.first_step_gap_limit
    assert record["logprob_mismatch/abs"] > 0 and record["logprob_mismatch/kl"] > 0
    assert record["rollout_correction/weight_mean"] == pytest.approx(1.0, abs=0.05)
    assert record["rollout_correction/truncated_frac"] == record["rollout_correction/masked_frac"] == 0.0
    _, before = load_hf(d / "sft_model")
    moved = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                for a, b in zip(_leaves(before), _leaves(state.params)))
    assert moved > 1e-5, f"{name}: the step did not move the params"


def _leaves(params):
    import jax

    return jax.tree.leaves(jax.device_get(params))


def test_first_step_guard_stops_a_sampler_at_another_temperature(sft_model, capsys, monkeypatch):
    # The trainer divides the logits by rl.temperature = 1.0; the sampler is made to draw at 2.0
    # (what a sampler built with another setting, or another checkpoint, looks like to the
    # trainer). GPG keeps every group, so the first step updates whatever the rewards.
    d = sft_model
    monkeypatch.setattr(rl_module, "SamplingParams", lambda temperature: SamplingParams(temperature=2.0))
    argv = ["rl", *rl_overrides(d, "run_guard", 2, *SMALL, "rl.algorithm=gpg", "rl.temperature=1.0")]
    status = main(argv)
    stderr = capsys.readouterr().err.strip()
    assert status == 2, stderr
    # After the progress bar, one line: the error, no traceback.
    err = stderr.splitlines()[-1]
    assert err.startswith("error: the sampler and the trainer disagree") and "Traceback" not in stderr
    assert [line for line in stderr.splitlines() if line.startswith("error:")] == [err]
    assert "rl.first_step_gap_limit=0.05" in err and "rl.temperature=1" in err
    assert "another checkpoint" in err and "rollout.serving_dtype" in err
    gap = float(err.split("log-perplexities differ by ")[1].split()[0])
    assert gap > 0.05
    # Stopped before its first update: nothing logged, no checkpoint.
    assert not (d / "run_guard" / "metrics.jsonl").exists() or not read_metrics(d / "run_guard")
    assert not list((d / "run_guard").glob("checkpoints/*"))
    # The same run with the check off trains, and logs the gap the guard measured.
    assert main(["rl", *rl_overrides(d, "run_unguarded", 1, *SMALL, "rl.algorithm=gpg",
                                     "rl.first_step_gap_limit=null")]) == 0
    [record] = read_metrics(d / "run_unguarded")
    assert record["logprob_mismatch/log_ppl_abs_diff"] == pytest.approx(gap, rel=1e-2)


def test_a_run_given_an_algorithm_by_value_records_its_name(sft_model, runtime, monkeypatch):
    config = load_config(RLJobConfig, overrides=rl_overrides(sft_model, "by_value", 1, *SMALL))
    ran = []
    monkeypatch.setattr(rl_module, "_run_rl", lambda config, algorithm, *rest: ran.append(config))
    run_rl(config, algorithm=ALGORITHMS["gspo"], runtime=runtime)
    assert config.rl.algorithm == "grpo_roc" and ran[0].rl.algorithm == "gspo"
