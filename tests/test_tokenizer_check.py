"""A model's tokenizer is checked before any work: missing files, another model's vocabulary,
chat markup that is not a single special token, and a tokenizer that does not round-trip a
prompt are refused with a message naming the directory."""
import json

import jax
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from helpers_qwen_tokenizer import qwen3_style_tokenizer
from rstar2_jax import chat
from rstar2_jax.errors import ModelError, TokenizerError
from rstar2_jax.model import ModelConfig, init_params, save_hf
from rstar2_jax.tokenizer import check_tokenizer, load_tokenizer, open_tokenizer

FMT = chat.ChatFormat()


def _model(path, vocab_size):
    config = ModelConfig(model_type="qwen3", vocab_size=vocab_size, hidden_size=8, intermediate_size=16,
                         num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4, qk_norm=True)
    save_hf(path, config, init_params(config, jax.random.key(0)))
    return config


def _plain_tokenizer(path, specials, added=(), normalizer=None):
    """A byte-level BPE with the given special and ordinary added tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.train_from_iterator([FMT.prompt_text("What is 12 + 30?")] * 3, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)
    return load_tokenizer(path)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    d = tmp_path_factory.mktemp("good")
    tokenizer = qwen3_style_tokenizer(d, [FMT.prompt_text("q")] * 3, base_vocab=1000, merges=300)
    return d, tokenizer, _model(d, 1032)


def test_a_qwen3_layout_tokenizer_passes(good):
    d, tokenizer, config = good
    check_tokenizer(tokenizer, config, FMT, d)
    check_tokenizer(tokenizer, config, chat.RELEASED_FORMAT, d)
    assert len(open_tokenizer(d, d, FMT)) == 1026


def test_missing_directory_and_missing_files(tmp_path, good):
    with pytest.raises(TokenizerError, match=f"tokenizer directory {tmp_path / 'nope'} does not exist"):
        load_tokenizer(tmp_path / "nope")
    # A model directory without tokenizer files: transformers would return a tokenizer that
    # encodes everything to [].
    _model(tmp_path / "model", 1032)
    with pytest.raises(TokenizerError, match=f"{tmp_path / 'model'} has no tokenizer"):
        open_tokenizer(tmp_path / "model", tmp_path / "model", FMT)
    with pytest.raises(ModelError, match=f"model directory {tmp_path / 'gone'} does not exist"):
        open_tokenizer(tmp_path / "gone", good[0], FMT)


def test_broken_tokenizer_file_is_named(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(TokenizerError, match=f"cannot load the tokenizer in {tmp_path}"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("specials, added, message", [
    (["<|endoftext|>", "<|im_start|>"], [], "no special token '<|im_end|>'"),
    (["<|endoftext|>", "<|im_end|>"], [], "no special token '<|im_start|>'"),
    (["<|endoftext|>"], ["<|im_start|>", "<|im_end|>"], "no special token '<|im_start|>'"),
])
def test_chat_markup_must_be_single_special_tokens(tmp_path, specials, added, message):
    tokenizer = _plain_tokenizer(tmp_path, specials, added)
    config = _model(tmp_path, len(tokenizer))
    with pytest.raises(TokenizerError, match=f"the tokenizer in {tmp_path} has {message}".replace("|", r"\|")):
        check_tokenizer(tokenizer, config, FMT, tmp_path)


@pytest.mark.parametrize("rows", [1000, 2100])
def test_another_models_vocabulary_is_refused(good, rows):
    d, tokenizer, _ = good
    config = ModelConfig(model_type="qwen3", vocab_size=rows, hidden_size=8, intermediate_size=16,
                         num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4, qk_norm=True)
    with pytest.raises(TokenizerError, match=f"1026 tokens but the model's embedding has {rows} rows"):
        check_tokenizer(tokenizer, config, FMT, d)


def test_a_tokenizer_that_changes_text_is_refused(tmp_path):
    tokenizer = _plain_tokenizer(tmp_path, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                 normalizer=normalizers.Lowercase())
    config = _model(tmp_path, len(tokenizer))
    with pytest.raises(TokenizerError, match="does not decode an encoded prompt back to its text"):
        check_tokenizer(tokenizer, config, FMT, tmp_path)
    assert json.loads((tmp_path / "tokenizer.json").read_text())["normalizer"]["type"] == "Lowercase"
