"""The main job at its tiny settings (`DemoConfig.tiny`), end to end, training, interrupted in
each phase and resumed; its exported model in transformers; the `--tiny` preset on the command
line."""
import dataclasses
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers

from rstar2_jax import chat
from rstar2_jax.config import ConfigError, load_config
from rstar2_jax.data.datasets import load_problems
from rstar2_jax.model import load_hf
from rstar2_jax.sampler import generate
from rstar2_jax.toy import TOY_FORMAT
from rstar2_jax.toy.demo import RL_CHECKPOINT_EVERY, SFT_CHECKPOINT_EVERY, DemoConfig, run_demo, weight_change
from rstar2_jax.train.metrics import read_metrics
from rstar2_jax.train.run import Run

# Where the job is interrupted: in each phase, a step after its first periodic checkpoint,
# before the next.
EVERY = {"sft": SFT_CHECKPOINT_EVERY, "rl": RL_CHECKPOINT_EVERY}
STOPS = {"sft": EVERY["sft"] + 10, "rl": EVERY["rl"] + 1}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The tiny job, interrupted (as by Ctrl-C) at SFT step STOPS["sft"], run again, interrupted at
    RL step STOPS["rl"], run again to its end: its config, summary, and (phase, step) of every
    step finished, in order."""
    cfg = DemoConfig.tiny(str(tmp_path_factory.mktemp("demo")))
    stops, done = dict(STOPS), []
    finish_step = Run.finish_step

    def interrupted(run, state, metrics, **kwargs):
        phase, step = run.run_dir.name, int(state.step)
        if stops.get(phase) == step:
            del stops[phase]
            raise KeyboardInterrupt
        finish_step(run, state, metrics, **kwargs)
        done.append((phase, step))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Run, "finish_step", interrupted)
        for _ in STOPS:
            with pytest.raises(KeyboardInterrupt):
                run_demo(cfg, progress=False)
        summary = run_demo(cfg, progress=False)
    return cfg, summary, done


def test_an_interrupted_job_resumes_each_phase_from_its_newest_checkpoint(demo):
    cfg, _, done = demo
    ends = {}
    for phase, stop in STOPS.items():
        steps = [step for p, step in done if p == phase]
        saved, end = EVERY[phase], steps[-1]
        # Up to the interrupt from scratch; then from the checkpoint before it to the end, once.
        assert steps == list(range(1, stop)) + list(range(saved + 1, end + 1))
        assert saved < stop < end, (phase, saved, stop, end)
        ends[phase] = end
    assert ends["rl"] == cfg.stage.steps


def test_tiny_main_job_runs_end_to_end(demo):
    cfg, summary, _ = demo
    out = cfg.out
    for report in (summary.sft, summary.rl):
        assert report.problems == 8 and report.samples_per_problem == 4
        assert set(report.pass_at) == {1, 4} and 0.0 <= report.pass_at[1] <= report.pass_at[4] <= 1.0
        assert report.mean_response_tokens > 0
    assert summary.gain == pytest.approx(summary.rl.pass_at[1] - summary.sft.pass_at[1])
    assert {"sft", "eval_sft", "rl", "eval_rl", "report", "total"} <= summary.seconds.keys()
    records = read_metrics(f"{out}/rl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for name in ("eval_sft", "eval_rl"):
        samples = [json.loads(line) for line in open(f"{out}/{name}.jsonl")]
        assert len(samples) == 8 * 4 and {"question", "answer", "reward", "tool_calls"} <= samples[0].keys()
    saved = json.loads(open(f"{out}/summary.json").read())
    assert saved["pass1_gain"] == pytest.approx(summary.gain)
    assert saved["kept_groups"] == summary.kept_groups == [int(r["groups/kept"]) for r in records]
    assert open(f"{out}/curves.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert "avg pass@1" in summary.table() and "RL gain" in summary.table()


def test_tiny_main_job_trains(demo):
    # The tiny run exists to train: its RL steps keep groups and the policy moves.
    cfg, summary, _ = demo
    records = read_metrics(f"{cfg.out}/rl")
    assert sum(summary.kept_groups) > 0 and summary.steps_without_update < len(records)
    updated = [r for r in records if r["groups/kept"] > 0]
    assert all("loss" in r and r["grad_norm"] > 0 for r in updated)
    assert weight_change(f"{cfg.out}/sft_model", f"{cfg.out}/rl_model") > 1e-4
    assert weight_change(f"{cfg.out}/sft_model", f"{cfg.out}/sft_model") == 0.0


def test_a_step_that_keeps_nothing_is_a_warning_in_the_summary(demo):
    _, summary, _ = demo
    table = dataclasses.replace(summary, kept_groups=[0, 3]).table()
    assert "groups kept per RL step: 0 3" in table
    assert "WARNING: 1 of 2 RL steps kept no group" in table
    assert "WARNING" not in dataclasses.replace(summary, kept_groups=[2, 3]).table()


def test_exported_model_greedy_generates_like_transformers(demo):
    cfg, _, _ = demo
    model_dir = f"{cfg.out}/rl_model"
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    config, params = load_hf(model_dir)
    prompts = [chat.encode_prompt(tokenizer, p.question, TOY_FORMAT)
               for p in load_problems(f"{cfg.out}/data/test.jsonl")[:2]]
    new_tokens = 24
    ours = generate(params, config, prompts, new_tokens, temperature=0.0)

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    eos = model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos)
    for prompt, generation in zip(prompts, ours):
        # Both stop at an end-of-sequence token (a barely trained toy may emit one first); forcing
        # transformers past it (min_new_tokens) would compare against a different decoding rule.
        tokens = list(generation.tokens)
        stop = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
        with torch.no_grad():
            theirs = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)
        np.testing.assert_array_equal(theirs[0, len(prompt):].numpy(), tokens[:stop])


def test_config_keeps_tool_rendering_consistent():
    with pytest.raises(ConfigError, match="render tools as the SFT demonstrations did"):
        load_config(DemoConfig, overrides=["rollout.show_tool_time=true"])
    for side in ("rollout", "data"):  # sessions in RL only, or in the demonstrations only
        with pytest.raises(ConfigError, match="tool_session must equal data's"):
            load_config(DemoConfig, overrides=[f"{side}.tool_session=true"])
    with pytest.raises(ConfigError, match="eval_problems"):
        load_config(DemoConfig, overrides=["eval_problems=100000"])


def test_config_refuses_more_questions_per_step_than_training_problems():
    with pytest.raises(ConfigError, match="rl.questions_per_step=65 exceeds the data.n_train=64"):
        load_config(DemoConfig, overrides=["data.n_train=64", "data.n_sft=32", "rl.questions_per_step=65"])


def test_cli_evaluates_the_exported_toy_model_from_a_fresh_interpreter(demo, tmp_path):
    # The toy's chat format is registered by the toy package; a user who points the CLI at the
    # toy's exported model must not need to import it first.
    cfg, _, _ = demo
    env = os.environ | {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax_cache")}
    done = subprocess.run(
        [sys.executable, "-m", "rstar2_jax", "eval", f"model.path={cfg.out}/rl_model",
         "model.chat_format=toy", f"dataset={cfg.out}/data/test.jsonl",
         f"output={tmp_path}/samples.jsonl", "samples=1", "limit=1", "max_turns=1",
         "max_response_tokens=8", "rollout.num_slots=1", "rollout.sandbox_workers=1"],
        env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert len(open(f"{tmp_path}/samples.jsonl").readlines()) == 1


def test_cli_tiny_preset_takes_overrides(monkeypatch, tmp_path):
    import rstar2_jax.toy.demo as demo_module
    from rstar2_jax.cli import main

    started = []
    monkeypatch.setattr(demo_module, "run_demo", started.append)
    assert main(["demo", "--tiny", f"out={tmp_path}", "stage.steps=2", "sft.epochs=3"]) == 0
    tiny = DemoConfig.tiny(str(tmp_path))
    assert started == [dataclasses.replace(tiny, stage=dataclasses.replace(tiny.stage, steps=2),
                                           sft=dataclasses.replace(tiny.sft, epochs=3))]


@pytest.mark.parametrize("override, key, use", [
    ("sft.seed=1", "sft.seed", "set `seed`"), ("sft.seq_len=512", "sft.seq_len", "longest demonstration"),
    ("sft.data=x.jsonl", "sft.data", "from `data`"), ("sft.run_dir=x", "sft.run_dir", "set `out`"),
    ("sft.model.path=x", "sft.model", "shape in `model`"),
    ("sft.precision.compute=bfloat16", "sft.precision", "set `precision`"),
    ("stage.dataset=x.jsonl", "stage.dataset", "from `data`")])
def test_config_refuses_the_job_settings_the_demo_derives(override, key, use):
    with pytest.raises(ConfigError, match=rf"{re.escape(key)} is set by the demo itself; .*{re.escape(use)}"):
        load_config(DemoConfig, overrides=[override])


def test_the_job_configs_hold_the_demos_settings_and_what_it_derives(tmp_path):
    from rstar2_jax.toy.demo import rl_config, sft_config

    cfg = DemoConfig.tiny(str(tmp_path))
    sft, rl = sft_config(cfg, tmp_path, 192), rl_config(cfg, tmp_path, "rl")
    assert dataclasses.replace(sft, model=cfg.sft.model, data="", run_dir="", seq_len=cfg.sft.seq_len) == cfg.sft
    assert (sft.seq_len, sft.data, sft.model.path) == (192, f"{tmp_path}/data/sft.jsonl", f"{tmp_path}/init_model")
    assert rl.stage == dataclasses.replace(cfg.stage, dataset=f"{tmp_path}/data/train.jsonl")
    assert (rl.optimizer, rl.rl, rl.limits) == (cfg.rl_optimizer, cfg.rl, cfg.limits)
