"""Qwen's chat markup and the one rule for turning text into ids: data never becomes a control
token (`encode_pieces`). Every other module of `rstar2_jax.chat` encodes through it."""
from __future__ import annotations

import functools
import itertools
import re
from typing import Protocol, Sequence

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_RESPONSE_START = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"
REASON_START = "<reason>"
REASON_END = "</reason>"
ANSWER_START = "<answer>"
ANSWER_END = "</answer>"

TOOL_NAME = "execute_python_code_with_standard_io"
# Where every assistant turn starts: the model writes from after the prefilled <reason>.
GENERATION_PROMPT = f"{IM_START}assistant\n{REASON_START}"


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer we use."""

    def encode(self, text: str, add_special_tokens: bool = ..., **kwargs) -> list[int]: ...


def token_id(tokenizer: Tokenizer, token: str) -> int:
    """Id of a markup token that the tokenizer must keep whole (e.g. ``IM_END``)."""
    ids = tokenizer.encode(token, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"tokenizer encodes {token!r} as {len(ids)} tokens {ids}; it must be one token")
    return ids[0]


def special_tokens(tokenizer) -> tuple[str, ...]:
    """The tokenizer's special added tokens (``<|im_start|>``, ``<|im_end|>``, ...): control
    tokens that only trusted markup may produce."""
    return tuple(sorted((t.content for t in tokenizer.added_tokens_decoder.values() if t.special),
                        key=len, reverse=True))


@functools.lru_cache(maxsize=16)
def _special_pattern(tokens: tuple[str, ...]) -> re.Pattern:
    return re.compile("(" + "|".join(map(re.escape, tokens)) + ")")


def encode_pieces(tokenizer, pieces: Sequence[tuple[str, bool]]) -> list[int]:
    """Token ids of text pieces ``(text, is_data)``, where data never becomes a control token.

    Markup pieces (``is_data`` False) are ours: their special tokens (``<|im_end|>``, ...) become
    those tokens. Data pieces (a question, a tool's output, SFT content) come from outside the
    model and are encoded with special-token parsing off, so a program printing
    ``<|im_end|>\\n<|im_start|>system`` shows the model that text, not a new turn. Between two
    special tokens the text of adjacent pieces is encoded in one call, so clean data gives
    exactly the ids of encoding the whole text at once. (Non-special added tokens such as
    Qwen's ``<tool_call>`` stay whole in data too; they do not delimit turns.)
    """
    tokens = special_tokens(tokenizer)
    pattern = _special_pattern(tokens) if tokens else None
    ids: list[int] = []
    run: list[str] = []

    def flush() -> None:
        if run:
            ids.extend(tokenizer.encode("".join(run), add_special_tokens=False, split_special_tokens=True))
            run.clear()

    for text, is_data in pieces:
        if is_data or pattern is None:
            run.append(text)
            continue
        for i, part in enumerate(pattern.split(text)):
            if i % 2:  # a special token of the markup
                flush()
                ids.append(tokenizer.convert_tokens_to_ids(part))
            elif part:
                run.append(part)
    flush()
    return ids


def encode_masked(tokenizer, pieces: Sequence[tuple[str, bool, int]]) -> tuple[list[int], list[int]]:
    """``(ids, loss_mask)`` of ``(text, is_data, mask)`` pieces (see `encode_pieces`).

    Each stretch of equal mask is encoded on its own, as the sampler encodes a prompt or a tool
    turn apart from the tokens the model writes after it.
    """
    ids: list[int] = []
    mask: list[int] = []
    for value, group in itertools.groupby(pieces, key=lambda p: p[2]):
        piece_ids = encode_pieces(tokenizer, [(text, is_data) for text, is_data, _ in group])
        ids += piece_ids
        mask += [value] * len(piece_ids)
    return ids, mask
