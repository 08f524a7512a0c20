"""export_hf: a checkpoint becomes a complete Hugging Face directory that the next stage opens
with nothing else set; bad inputs stop before anything is read or written."""
import json

import jax
import numpy as np
import pytest

from helpers_qwen_tokenizer import qwen3_style_tokenizer
from rstar2_jax import chat
from rstar2_jax.errors import ModelError, OutputError, TokenizerError
from rstar2_jax.model import ModelConfig, init_params, load_hf, save_hf
from rstar2_jax.tokenizer import open_tokenizer
from rstar2_jax.train.checkpoint import Checkpointer, export_hf
from rstar2_jax.train.configs import OptimizerConfig
from rstar2_jax.train.optim import make_optimizer
from rstar2_jax.train.step import init_train_state

BASE_VOCAB = 1000
GENERATION = {"bos_token_id": 1001, "do_sample": True, "eos_token_id": [1002, 1000],
              "temperature": 0.6, "top_p": 0.95}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A starting model directory (Qwen3-layout tokenizer with a chat template, a generation
    config) and a run's checkpoints at steps 7 and 8 whose job config names it."""
    d = tmp_path_factory.mktemp("export")
    tokenizer = qwen3_style_tokenizer(d / "base", [chat.ChatFormat().prompt_text("1 + 1?")] * 4,
                                      base_vocab=BASE_VOCAB, merges=200)
    config = ModelConfig(model_type="qwen3", vocab_size=len(tokenizer) + 6, hidden_size=16,
                         intermediate_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                         head_dim=8, qk_norm=True, eos_token_id=(1002, 1000))
    save_hf(d / "base", config, init_params(config, jax.random.key(0)))
    (d / "base" / "generation_config.json").write_text(json.dumps(GENERATION))
    ckpt = Checkpointer(d / "run" / "checkpoints")
    opt = make_optimizer(OptimizerConfig(lr=1e-3), total_steps=10)
    states = {}
    for step, seed in ((7, 3), (8, 4)):
        states[step] = init_train_state(init_params(config, jax.random.key(seed)), opt, step=step)
        ckpt.save(states[step], rng=jax.random.key(step), data_position={}, model_config=config,
                  job_config={"model": {"path": str(d / "base"), "tokenizer": None}})
    ckpt.close()
    return d, config, states


def _same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_export_is_a_complete_model_directory_for_the_next_stage(run, tmp_path):
    d, config, states = run
    assert export_hf(d / "run" / "checkpoints", tmp_path / "hf", step=7) == 7
    files = {p.name for p in (tmp_path / "hf").iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "chat_template.jinja"} <= files
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text()) == GENERATION
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / "hf" / name).read_bytes() == (d / "base" / name).read_bytes()
    # The next stage's model.path, no tokenizer override: it opens and validates.
    tokenizer = open_tokenizer(tmp_path / "hf", tmp_path / "hf", chat.ChatFormat())
    assert tokenizer.chat_template and len(tokenizer) == BASE_VOCAB + 26
    exported_config, params = load_hf(tmp_path / "hf")
    assert exported_config == config
    _same(params, states[7].params)
    assert export_hf(d / "run" / "checkpoints", tmp_path / "latest") == 8


def test_missing_checkpoint_directory_is_named_and_not_created(tmp_path):
    with pytest.raises(ModelError, match=f"checkpoint directory {tmp_path / 'nope'} does not exist"):
        export_hf(tmp_path / "nope", tmp_path / "out")
    assert not (tmp_path / "nope").exists() and not (tmp_path / "out").exists()


def test_missing_step_is_named(run, tmp_path):
    with pytest.raises(ModelError, match=r"no checkpoint for step 5 \(have \[7, 8\]\)"):
        export_hf(run[0] / "run" / "checkpoints", tmp_path / "out", step=5)


def test_a_moved_starting_model_needs_the_tokenizer_flag(run, tmp_path):
    d, config, _ = run
    moved = tmp_path / "moved"
    (d / "base").rename(moved)
    try:
        with pytest.raises(TokenizerError, match=f"{d / 'base'} does not exist.*--tokenizer"):
            export_hf(d / "run" / "checkpoints", tmp_path / "out")
        assert not (tmp_path / "out").exists()
        assert export_hf(d / "run" / "checkpoints", tmp_path / "out", tokenizer=moved) == 8
        assert (tmp_path / "out" / "tokenizer.json").exists()
    finally:
        moved.rename(d / "base")


def test_a_tokenizer_of_another_model_is_refused(run, tmp_path):
    d, _, _ = run
    other = qwen3_style_tokenizer(tmp_path / "other", ["x"], base_vocab=300, merges=10)
    assert len(other) == 326
    with pytest.raises(TokenizerError, match="326 tokens but the model's embedding has 1032 rows"):
        export_hf(d / "run" / "checkpoints", tmp_path / "out", tokenizer=tmp_path / "other")


def test_unwritable_output_fails_before_restoring(run, tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(OutputError, match="cannot write the export directory .*file/out"):
        export_hf(run[0] / "run" / "checkpoints", tmp_path / "file" / "out")


def test_export_writes_the_master_dtype_or_the_one_asked_for(run, tmp_path):
    d, config, states = run
    export_hf(d / "run" / "checkpoints", tmp_path / "master", step=8)
    export_hf(d / "run" / "checkpoints", tmp_path / "half", step=8, dtype="bfloat16")
    master = json.loads((tmp_path / "master" / "config.json").read_text())
    half = json.loads((tmp_path / "half" / "config.json").read_text())
    assert (master["dtype"], half["dtype"]) == ("float32", "bfloat16")
    size = {name: (tmp_path / name / "model.safetensors").stat().st_size for name in ("master", "half")}
    assert size["half"] < 0.6 * size["master"]
    _, exact = load_hf(tmp_path / "master")
    _same(exact, states[8].params)
    _, rounded = load_hf(tmp_path / "half")  # float32 master weights again, rounded once
    _same(rounded, jax.tree.map(lambda x: x.astype("bfloat16").astype("float32"), states[8].params))
