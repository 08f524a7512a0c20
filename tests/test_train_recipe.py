"""The paper's staged recipe: configs load, and the three stages chain (init_from, optimizer
reset, continued step count) with one RL update each on a tiny random checkpoint; a stage's
reference policy is its initial weights, fresh or resumed."""
from pathlib import Path

import jax
import numpy as np
import pytest

from rstar2_jax.algorithms import resolve_algorithm
from rstar2_jax.config import load_config
from rstar2_jax.model import ModelConfig, init_params, load_hf, save_hf
from rstar2_jax.train.configs import RLJobConfig, SFTConfig
from rstar2_jax.rl.loop import reference_params
from rstar2_jax.rl.update import RLUpdate
from rstar2_jax.train.run import start_run

PAPER = Path(__file__).resolve().parents[1] / "experiments" / "paper"
MODEL = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True)


def test_paper_configs_mirror_the_paper():
    stages = [load_config(RLJobConfig, PAPER / f"stage{i}.yaml") for i in (1, 2, 3)]
    assert [s.stage.steps for s in stages] == [300, 85, 125]
    assert [s.stage.max_response_tokens for s in stages] == [8192, 12288, 12288]
    assert [s.stage.max_turns for s in stages] == [10, 10, 15]
    assert [s.stage.reset_optimizer for s in stages] == [False, False, True]
    assert stages[2].stage.dataset == stages[2].hard_subset.output
    assert stages[2].hard_subset.samples == 8
    for s in stages:
        assert s.rl.questions_per_step == 512
        assert (s.rl.rollouts_per_question, s.rl.group_size) == (32, 16)
        assert (s.rl.algorithm, s.rl.temperature) == ("grpo_roc", 1.0)
        assert (s.optimizer.lr, s.optimizer.schedule, s.optimizer.warmup_steps) == (1e-6, "constant", 20)
    sft = load_config(SFTConfig, PAPER / "sft.yaml")
    assert (sft.optimizer.lr, sft.optimizer.schedule, sft.epochs, sft.batch_size) == (5e-6, "cosine", 3, 128)


def _batch(rows=8, seq=16, seed=0):
    rng = np.random.default_rng(seed)
    positions = np.arange(seq)[None]
    lengths = rng.integers(8, seq + 1, rows)[:, None]
    attention = (positions < lengths).astype(np.int32)
    return {"tokens": rng.integers(1, MODEL.vocab_size, (rows, seq)).astype(np.int32),
            "attention_mask": attention, "loss_mask": attention * (positions >= 4),
            "advantages": rng.normal(size=rows).astype(np.float32),
            "sampler_logp": np.full((rows, seq), -4.0, np.float32)}


def test_stages_chain_on_a_tiny_checkpoint(tmp_path):
    save_hf(tmp_path / "model", MODEL, init_params(MODEL, jax.random.key(0)))
    previous_params, steps, counts = None, [], []
    for i in (1, 2, 3):
        overrides = [f"model.path={tmp_path / 'model'}", f"run_dir={tmp_path / f'stage{i}'}",
                     "stage.steps=1", "rl.micro_batch_size=4", "mesh.fsdp=4", "mesh.tp=2",
                     "optimizer.lr=1e-2", "optimizer.warmup_steps=1"]
        if i > 1:
            overrides.append(f"stage.init_from={tmp_path / f'stage{i - 1}'}")
        cfg = load_config(RLJobConfig, PAPER / f"stage{i}.yaml", overrides)
        run = start_run(run_dir=cfg.run_dir, model=cfg.model, optimizer=cfg.optimizer,
                        total_steps=cfg.stage.steps, job_config=cfg, seed=cfg.seed, mesh=cfg.mesh,
                        checkpoint=cfg.checkpoint, init_from=cfg.stage.init_from,
                        reset_optimizer=cfg.stage.reset_optimizer, progress=False)
        if previous_params is not None:  # the stage starts where the previous one ended
            for a, b in zip(jax.tree.leaves(previous_params), jax.tree.leaves(run.state.params)):
                np.testing.assert_array_equal(a, np.asarray(b))
        update = RLUpdate(run.model_config, cfg.rl, run.optimizer, mesh=run.mesh,
                          param_specs=run.param_specs, params=run.state.params,
                          loss=resolve_algorithm(cfg.rl.algorithm).loss)
        state, metrics = update(run.state, _batch(seed=i))
        assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
        run.finish_step(state, metrics, rng=run.rng, data_position={"question": 8 * i})
        steps.append((run.start_step, run.step, run.end_step))
        counts.append(int(state.opt_state.count))
        previous_params = jax.tree.map(np.asarray, state.params)
        run.close()
    assert steps == [(0, 1, 1), (1, 2, 2), (2, 3, 3)]
    # Stage 2 continues the optimizer (its 2nd update); stage 3 resets it (a 1st update again).
    assert counts == [1, 2, 1]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_each_paper_stage_runs_one_rl_step(tmp_path, stage):
    """The paper's stage configs, shrunk by overrides only, run one real RL step (rollouts in the
    sandbox, rewards from the verifier) on a tiny random checkpoint."""
    from rstar2_jax import chat
    from rstar2_jax.data.datasets import Problem, save_problems
    from rstar2_jax.toy.tokenizer import build_tokenizer
    from rstar2_jax.train.metrics import read_metrics
    from rstar2_jax.rl.loop import run_rl

    problems = [Problem(f"What is {i} + {i}?", str(2 * i)) for i in range(4)]
    save_problems(tmp_path / "problems.jsonl", problems)
    fmt = chat.get_format("rstar2")
    tokenizer = build_tokenizer([fmt.prompt_text(p.question) for p in problems] * 3, vocab_size=600)
    model = ModelConfig(model_type="qwen3", vocab_size=len(tokenizer), hidden_size=16,
                        intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                        head_dim=8, qk_norm=True)
    save_hf(tmp_path / "model", model, init_params(model, jax.random.key(stage)))
    tokenizer.save_pretrained(tmp_path / "model")
    prompt_tokens = max(len(chat.encode_prompt(tokenizer, p.question, fmt)) for p in problems)
    cfg = load_config(RLJobConfig, PAPER / f"stage{stage}.yaml", [
        f"model.path={tmp_path / 'model'}", f"run_dir={tmp_path / 'run'}", "stage.init_from=null",
        f"stage.dataset={tmp_path / 'problems.jsonl'}", "stage.steps=1",
        "stage.max_response_tokens=16", "rl.questions_per_step=2", "rl.rollouts_per_question=4",
        "rl.group_size=2", f"rl.max_prompt_tokens={prompt_tokens}", "rl.micro_batch_size=null",
        "mesh.fsdp=1", "rollout.num_slots=8", "rollout.sandbox_workers=1"])
    state = run_rl(cfg, progress=False)
    assert int(state.step) == 1
    (record,) = read_metrics(tmp_path / "run")
    assert record["step"] == 1 and record["groups/total"] == 2
    assert record["response/length_max"] <= 16


def test_the_reference_is_the_stage_initial_weights_fresh_and_resumed(tmp_path):
    # rl.reference of a stage: its initial weights, whether the run starts fresh or resumes
    # (the params have moved by then), from the previous stage's checkpoint or from model.path.
    save_hf(tmp_path / "model", MODEL, init_params(MODEL, jax.random.key(0)))
    ends = {}

    def run_stage(name, steps, init_from=None):
        overrides = [f"model.path={tmp_path / 'model'}", f"run_dir={tmp_path / name}",
                     "stage.name=s", f"stage.steps={steps}", "stage.dataset=unused.jsonl",
                     "checkpoint.every=1", "mesh.fsdp=4", "mesh.tp=2", "optimizer.lr=1e-2",
                     "optimizer.warmup_steps=1", "rl.reference=true", "rl.kl_coef=0.1"]
        if init_from:
            overrides.append(f"stage.init_from={tmp_path / init_from}")
        cfg = load_config(RLJobConfig, overrides=overrides)
        run = start_run(run_dir=cfg.run_dir, model=cfg.model, optimizer=cfg.optimizer,
                        total_steps=cfg.stage.steps, job_config=cfg, seed=cfg.seed, mesh=cfg.mesh,
                        checkpoint=cfg.checkpoint, init_from=cfg.stage.init_from, progress=False)
        reference = reference_params(cfg, run)
        update = RLUpdate(run.compute_config, cfg.rl, run.optimizer, mesh=run.mesh,
                          param_specs=run.param_specs, params=run.state.params, reference=reference,
                          loss=resolve_algorithm(cfg.rl.algorithm).loss)
        step = run.step
        state, metrics = update(run.state, _batch(seed=step))  # donates run.state
        run.finish_step(state, metrics, rng=run.rng, data_position={"question": step + 1})
        ends[name] = jax.tree.map(np.asarray, state.params)
        run.close()
        return jax.tree.map(np.asarray, reference), metrics

    _, initial = load_hf(tmp_path / "model")
    reference, first = run_stage("one", 2)
    _assert_same(reference, initial)
    assert first["ref_kl"] == 0.0  # the policy is the reference before its first update
    reference, resumed = run_stage("one", 2)  # resumed at step 1 of 2
    _assert_same(reference, initial)
    assert resumed["ref_kl"] > 0 and resumed["kl_loss"] > 0
    stage_one = ends["one"]
    reference, _ = run_stage("two", 2, init_from="one")
    _assert_same(reference, stage_one)
    reference, _ = run_stage("two", 2, init_from="one")  # resumed
    _assert_same(reference, stage_one)


def _assert_same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
