"""A small Qwen-style tokenizer trained on the toy corpus, saved in Hugging Face format.

It is built like Qwen2's: byte-level BPE behind Qwen's split pattern, which puts every digit in
its own pre-token, so numbers are copied digit by digit and no merge can span two digits. Unlike
Qwen2 it has no NFC normalizer, so decoding gives back exactly the text that was encoded. The
chat markup tokens are added whole, with Qwen's convention: ``<|...|>`` tokens are special
(dropped by ``decode(skip_special_tokens=True)``), the tool tags are ordinary added tokens that
survive decoding.
"""
from __future__ import annotations

from typing import Iterable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from rstar2_jax.chat import (
    ENDOFTEXT,
    IM_END,
    IM_START,
    TOOL_CALL_END,
    TOOL_CALL_START,
    TOOL_RESPONSE_END,
    TOOL_RESPONSE_START,
)

SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
TOOL_TOKENS = (TOOL_CALL_START, TOOL_CALL_END, TOOL_RESPONSE_START, TOOL_RESPONSE_END)

# Qwen2's pre-tokenization pattern: contractions, letter runs, single digits, punctuation runs,
# newlines and spaces.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def build_tokenizer(corpus: Iterable[str], vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """Train the tokenizer on ``corpus`` (an iterable of documents).

    The vocabulary holds the 256 byte tokens, the markup tokens and BPE merges up to
    ``vocab_size`` entries. Save it with ``save_pretrained(directory)``; it then loads with
    ``transformers.AutoTokenizer.from_pretrained(directory)``.
    """
    n_fixed = 256 + len(SPECIAL_TOKENS) + len(TOOL_TOKENS)
    if vocab_size <= n_fixed:
        raise ValueError(f"vocab_size must exceed {n_fixed} (bytes and markup tokens); got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS + TOOL_TOKENS),  # fixed ids 0..6
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    # Registering the markup as added tokens makes the tokenizer cut it out of any text whole.
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=ENDOFTEXT,
        pad_token=ENDOFTEXT,
        unk_token=None,
        clean_up_tokenization_spaces=False,
    )
