"""Every CLI entry point reports bad input in one line naming the file, exit status 2, before
any work (issue 13, item 11; issue 12: a model directory without a tokenizer)."""
import json
import re
import subprocess
import sys

import jax
import pytest

from helpers_qwen_tokenizer import qwen3_style_tokenizer
from rstar2_jax import chat, evaluate
from rstar2_jax.cli import main
from rstar2_jax.data.datasets import Problem, save_problems
from rstar2_jax.model import ModelConfig, init_params, save_hf
from rstar2_jax.sampler.runtime import RolloutRuntime


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny Qwen3 model with its tokenizer, one without (config + weights only), a tokenizer
    without <|im_end|>, a problem set, an empty one and SFT data."""
    d = tmp_path_factory.mktemp("cli")
    tokenizer = qwen3_style_tokenizer(d / "model", [chat.ChatFormat().prompt_text("1 + 1?")] * 3,
                                      base_vocab=1000, merges=300)
    config = ModelConfig(model_type="qwen3", vocab_size=len(tokenizer) + 6, hidden_size=8,
                         intermediate_size=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4,
                         qk_norm=True)
    for name in ("model", "bare"):
        save_hf(d / name, config, init_params(config, jax.random.key(0)))
    qwen3_style_tokenizer(d / "no_im_end", ["x"], base_vocab=1000, merges=10, without=("<|im_end|>",))
    save_problems(d / "problems.jsonl", [Problem("What is 1 + 1?", "2")])
    (d / "empty.jsonl").write_text("")
    (d / "sft.jsonl").write_text(json.dumps({"messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}) + "\n")
    (d / "a_file").write_text("")
    return d


@pytest.fixture(autouse=True)
def no_rollouts(monkeypatch):
    """Bad input must stop a job before its sandbox and verifier pools start."""
    def refuse(self):
        raise AssertionError("the job started its rollout pools before checking its input")
    monkeypatch.setattr(RolloutRuntime, "__enter__", refuse)


def _run(capsys, *argv):
    status = main(list(argv))
    err = capsys.readouterr().err.strip()
    assert status == 2, err
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    return err


def _eval(d, *overrides):
    return ("eval", f"model.path={d}/model", f"dataset={d}/problems.jsonl", f"output={d}/out.jsonl",
            "samples=1", "max_response_tokens=8", "max_prompt_tokens=512", *overrides)


def _rl(d, *overrides):
    return ("rl", f"model.path={d}/model", f"run_dir={d}/run_rl", "stage.name=s", "stage.steps=1",
            f"stage.dataset={d}/problems.jsonl", "rl.questions_per_step=1", *overrides)


def test_model_directory_without_a_tokenizer(files, capsys):
    err = _run(capsys, *_rl(files, f"model.path={files}/bare"))
    assert f"{files}/bare has no tokenizer" in err
    assert not (files / "run_rl").exists()


def test_tokenizer_without_im_end_in_rl_eval_and_sft(files, capsys):
    message = f"the tokenizer in {files}/no_im_end has no special token '<|im_end|>'"
    assert message in _run(capsys, *_rl(files, f"model.tokenizer={files}/no_im_end"))
    assert message in _run(capsys, *_eval(files, f"model.tokenizer={files}/no_im_end"))
    assert message in _run(capsys, "sft", f"model.path={files}/model", f"model.tokenizer={files}/no_im_end",
                           f"data={files}/sft.jsonl", f"run_dir={files}/run_sft")
    assert not (files / "run_sft").exists()


def test_eval_on_an_empty_dataset(files, capsys):
    assert f"dataset {files}/empty.jsonl holds no problems" in _run(
        capsys, *_eval(files, f"dataset={files}/empty.jsonl"))


def test_missing_model_directory(files, capsys):
    err = _run(capsys, *_eval(files, f"model.path={files}/nowhere"))
    assert f"model directory {files}/nowhere does not exist" in err and "Repo id" not in err


def test_unwritable_eval_output_fails_before_the_evaluation(files, capsys, monkeypatch):
    monkeypatch.setattr(evaluate, "load_hf", lambda *a: pytest.fail("loaded the model"), raising=False)
    err = _run(capsys, *_eval(files, f"output={files}/a_file/out.jsonl"))
    assert f"cannot write the evaluation output {files}/a_file/out.jsonl: {files}/a_file is a file" in err


def test_unwritable_hard_subset_output_and_missing_previous_stage(files, capsys):
    rl = _rl(files)[1:]
    assert "cannot write the hard subset" in _run(
        capsys, "hard-subset", *rl, f"hard_subset.source={files}/problems.jsonl",
        f"hard_subset.output={files}/a_file/hard.jsonl")
    assert f"stage.init_from={files}/nowhere has no checkpoints directory" in _run(
        capsys, "hard-subset", *rl, f"stage.init_from={files}/nowhere",
        f"hard_subset.source={files}/problems.jsonl", f"hard_subset.output={files}/hard.jsonl")


def test_rl_sizes_the_algorithm_cannot_run_with(files, capsys):
    err = _run(capsys, *_rl(files, "rl.rollouts_per_question=2", "rl.group_size=1"))
    assert "cannot run with rl.rollouts_per_question=2 and rl.group_size=1" in err


def test_rl_more_questions_per_step_than_problems(files, capsys):
    err = _run(capsys, *_rl(files, "rl.questions_per_step=2"))  # one problem in the dataset
    assert f"rl.questions_per_step=2 exceeds the 1 problems of stage.dataset={files}/problems.jsonl" in err
    assert not (files / "run_rl").exists()


def test_export_of_a_missing_path_creates_nothing(files, capsys):
    err = _run(capsys, "export", f"{files}/no_run/checkpoints", f"{files}/exported")
    assert f"checkpoint directory {files}/no_run/checkpoints does not exist" in err
    assert not (files / "no_run").exists() and not (files / "exported").exists()


def test_missing_sft_data_is_named(files, capsys):
    assert f"cannot read the SFT data {files}/nope.jsonl" in _run(
        capsys, "sft", f"model.path={files}/model", f"data={files}/nope.jsonl", f"run_dir={files}/r")


def test_debug_shows_the_traceback(files):
    with pytest.raises(Exception, match="holds no problems"):
        main([*_eval(files, f"dataset={files}/empty.jsonl"), "--debug"])


def test_one_line_from_a_fresh_process(files):
    proc = subprocess.run([sys.executable, "-m", "rstar2_jax", *_eval(files, f"model.path={files}/nowhere")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"error: model directory {files}/nowhere does not exist (model.path "
                                   f"must be a local Hugging Face checkpoint directory with config.json "
                                   f"and *.safetensors)")


@pytest.mark.parametrize("override, message", [
    ("rollout.num_slots=1000000000", "temporaries .* for 1000000000 slots"),
    ("stage.max_response_tokens=1000000000000", r"one row of 100000000\d{4} tokens"),
])
def test_rollout_sizes_no_device_can_hold_stop_before_any_work(files, capsys, override, message):
    """Issue 51: accepted, then the engine tried to allocate them at the first rollout (on CPU,
    the host's memory); refused now before the pools start (the `no_rollouts` fixture)."""
    err = _run(capsys, *_rl(files, override))
    assert err.startswith("error: the rollout engine needs at least ") and re.search(message, err), err
    assert not (files / "run_rl").exists()
    assert re.search(message, _run(capsys, *_eval(files, override.replace("stage.", ""))))


def test_more_sandbox_templates_than_the_host_holds_stop_at_the_config(files, capsys, monkeypatch):
    """Issue 51: `rollout.sandbox_workers=1000` started a thousand templates of ~64 MiB each."""
    from rstar2_jax.sandbox import config as sandbox_config

    monkeypatch.setattr(sandbox_config, "host_memory_bytes", lambda: 24 << 30)
    err = _run(capsys, *_rl(files, "rollout.sandbox_workers=1000"))
    assert ("rollout.sandbox_workers=1000: 1000 sandbox templates take about 62.5 GiB at rest (64 MiB "
            "each, before any call), more than this host's 24.0 GiB: use at most 384") in err
    err = _run(capsys, *_rl(files, "rollout.sandbox_workers=384", "rl.questions_per_step=2"))
    assert "rl.questions_per_step=2 exceeds" in err  # 384 fit: the next check speaks
