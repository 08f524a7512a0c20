"""The toy tokenizer: HF round trip, whole markup tokens, digit-by-digit numbers, lossless text."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from rstar2_jax import chat
from rstar2_jax.toy import TOY_FORMAT
from rstar2_jax.toy.problems import make_splits
from rstar2_jax.toy.tokenizer import SPECIAL_TOKENS, TOOL_TOKENS, build_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    train, _ = make_splits(400, 0, seed=5)
    corpus = [TOY_FORMAT.prompt_text(p.question) + chat.format_tool_call(p.code)
              + chat.tool_response_text(f"Tool call success\nstdout: {p.answer}") for p in train]
    directory = tmp_path_factory.mktemp("toy_tokenizer")
    build_tokenizer(corpus, vocab_size=700).save_pretrained(directory)
    return AutoTokenizer.from_pretrained(directory)


def test_vocab_is_small_and_markup_has_fixed_ids(tokenizer):
    assert len(tokenizer) <= 700
    assert [chat.token_id(tokenizer, t) for t in SPECIAL_TOKENS + TOOL_TOKENS] == list(range(7))
    assert tokenizer.eos_token == tokenizer.pad_token == chat.ENDOFTEXT


def test_special_tokens_are_dropped_by_decode_but_tool_tags_kept(tokenizer):
    text = f"{chat.IM_START}assistant\n<tool_call>x</tool_call>{chat.IM_END}{chat.ENDOFTEXT}"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids, skip_special_tokens=True) == "assistant\n<tool_call>x</tool_call>"


def test_no_token_merges_a_digit_with_anything(tokenizer):
    for token_id in range(len(tokenizer)):
        piece = tokenizer.decode([token_id])
        if any(c.isdigit() for c in piece):
            assert len(piece) == 1, piece


def test_numbers_are_copied_digit_by_digit(tokenizer):
    ids = tokenizer.encode("print(918273645 % 97)", add_special_tokens=False)
    pieces = [tokenizer.decode([i]) for i in ids]
    assert "".join(pieces) == "print(918273645 % 97)"
    assert [p for p in pieces if p.isdigit()] == list("91827364597")


def test_training_compresses_the_corpus_language(tokenizer):
    ids = tokenizer.encode(chat.format_tool_call("print(1)"), add_special_tokens=False)
    assert len(ids) < len(chat.format_tool_call("print(1)")) / 3


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=80))
def test_any_text_round_trips(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_unnormalized_text_round_trips(tokenizer):
    text = "cafe\u0301 \u212b"  # decomposed e-acute and the angstrom sign, both changed by NFC
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_vocab_size_must_leave_room_for_merges():
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(["abc"], vocab_size=200)
