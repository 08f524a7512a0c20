"""SFT data: JSONL conversations in the standard chat layout, as token ids and loss masks.

One conversation per line: ``{"messages": [...], "tools": [...]}`` (``tools`` optional: OpenAI
function schemas, as function-calling datasets carry them). The messages follow
:func:`rstar2_jax.chat.normalize_messages`: an optional system message, any number of user and
assistant turns, assistant ``tool_calls`` (arguments as an object or its JSON text) and
``tool`` messages. Each conversation is rendered one of two ways:

- **agent trajectory**: it calls the chat format's tool (in ``tool_calls``, or as
  ``<tool_call>`` text in an assistant content, the layout the toy's demonstrations use), or
  the tokenizer has no chat template: rendered by :func:`rstar2_jax.chat.encode_conversation`,
  exactly the tokens the sampler builds (the format's system prompt unless a system message
  replaces it, the user template around each question, ``<reason>`` prefilled);
- **general chat** (instruction following, chat, calls to other tools), when the tokenizer has
  a chat template: rendered by that template, as the model's own chat would be.

Either way every content is data (markup in it stays text) and the loss mask is 1 on the
assistant's tokens only: from after ``<|im_start|>assistant\\n`` through its ``<|im_end|>``.
"""
from __future__ import annotations

import collections
import json
import logging
import re
import secrets
from typing import Iterator

from rstar2_jax import chat
from rstar2_jax.data.datasets import jsonl_rows
from rstar2_jax.errors import DataError

log = logging.getLogger(__name__)

_ASSISTANT_HEADER = f"{chat.IM_START}assistant\n"


class Conversations:
    """The conversations of a JSONL file as ``(token ids, loss mask)``, encoded on demand.

    Process ``process_index`` of ``process_count`` encodes rows ``process_index``,
    ``process_index + process_count``, ... when built, which checks every row of the file once
    over all processes, and keeps them; any other row is encoded when asked for. So each
    process of a multi-process run encodes about its share of the file, whichever rows its
    steps feed; one process encodes everything up front.

    Raises DataError naming the file and line for a missing file, a malformed row, a
    conversation longer than ``seq_len`` (truncating would silently train on a cut-off answer)
    or one with no assistant token.
    """

    def __init__(self, path: str, tokenizer, fmt: chat.ChatFormat, seq_len: int, *,
                 process_index: int = 0, process_count: int = 1):
        self.path, self._tokenizer, self._fmt, self._seq_len = path, tokenizer, fmt, seq_len
        self._rows = list(jsonl_rows(path, "the SFT data"))
        if not self._rows:
            raise DataError(f"{path} holds no conversation")
        kinds = collections.Counter()
        self._own = {}
        for i in range(process_index, len(self), process_count):
            kind, self._own[i] = self._encode(i)
            kinds[kind] += 1
        log.info("%s: %d agent trajectories in the %s layout, %d general-chat conversations "
                 "rendered with the tokenizer's chat template%s", path, kinds["agent"],
                 "chat format's", kinds["chat"],
                 f" (this process's share, 1 in {process_count})" if process_count > 1 else "")

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, i: int) -> tuple[list[int], list[int]]:
        return self._own[i] if i in self._own else self._encode(i)[1]

    def __iter__(self) -> Iterator[tuple[list[int], list[int]]]:
        return (self[i] for i in range(len(self)))

    def _encode(self, i: int) -> tuple[str, tuple[list[int], list[int]]]:
        line_number, row = self._rows[i]
        where = f"{self.path}, line {line_number}"
        if not isinstance(row, dict) or "messages" not in row:
            raise DataError(f'{where}: expected an object {{"messages": [...]}}')
        try:
            kind, (ids, mask) = encode_row(self._tokenizer, row["messages"], self._fmt, row.get("tools"))
        except ValueError as e:
            raise DataError(f"{where}: {e}") from None
        if len(ids) > self._seq_len:
            raise DataError(f"{where}: {len(ids)} tokens, more than seq_len={self._seq_len}")
        if not any(mask):
            raise DataError(f"{where}: no assistant token to train on")
        return kind, (ids, mask)


def encode_row(tokenizer, messages, fmt: chat.ChatFormat, tools=None) -> tuple[str, tuple[list[int], list[int]]]:
    """``(kind, (ids, loss_mask))`` of one conversation; kind is "agent" or "chat" (see the
    module docstring). Raises ValueError saying what is wrong with it."""
    normalized = chat.normalize_messages(messages)
    if getattr(tokenizer, "chat_template", None) and not calls_format_tool(normalized, fmt):
        return "chat", encode_with_template(tokenizer, normalized, tools)
    return "agent", chat.encode_conversation(tokenizer, normalized, fmt)


def calls_format_tool(messages: list[dict], fmt: chat.ChatFormat) -> bool:
    """Whether a normalized conversation calls ``fmt``'s tool, structured or as text."""
    for m in messages:
        if any(c["name"] == fmt.tool_name for c in m["tool_calls"]):
            return True
        if m["role"] == "assistant" and any(fmt.tool_name in body for body in _INLINE_CALL.findall(m["content"])):
            return True
    return False


_INLINE_CALL = re.compile(re.escape(chat.TOOL_CALL_START) + r"(.*?)(?:" + re.escape(chat.TOOL_CALL_END) + "|$)",
                          re.DOTALL)


def encode_with_template(tokenizer, messages: list[dict], tools=None) -> tuple[list[int], list[int]]:
    """``(ids, loss_mask)`` of a normalized conversation rendered by the tokenizer's chat template.

    The template is rendered with a placeholder for every content and every string in the tool
    calls' arguments; its own text is markup, the placeholders' values are data. A template
    that drops or repeats a content is refused rather than trained on.
    """
    if tools is not None and not isinstance(tools, list):
        raise ValueError(f"'tools' must be a list of function schemas, got {type(tools).__name__}")
    tools_text = json.dumps(tools or [], ensure_ascii=False)
    for token in chat.special_tokens(tokenizer):
        if token in tools_text:
            raise ValueError(f"the tools schemas contain the control token {token!r}")
    marker = _marker(json.dumps(messages, ensure_ascii=False) + tools_text)
    values: list[str] = []

    def hold(text: str, escaped: bool = False) -> str:
        values.append(json.dumps(text, ensure_ascii=False)[1:-1] if escaped else text)
        return f"{marker}{len(values) - 1}{marker}"

    rendered_messages = []
    for m in messages:
        message = {"role": m["role"], "content": hold(m["content"]) if m["content"] else ""}
        if m["tool_calls"]:
            message["tool_calls"] = [
                {"type": "function", "function": {"name": c["name"],
                                                  "arguments": _hold_strings(c["arguments"], hold)}}
                for c in m["tool_calls"]]
        rendered_messages.append(message)
    text = tokenizer.apply_chat_template(rendered_messages, tools=tools, tokenize=False)
    parts = re.split(f"{re.escape(marker)}(\\d+){re.escape(marker)}", text)
    used = collections.Counter(int(i) for i in parts[1::2])
    if sorted(used) != list(range(len(values))) or any(n != 1 for n in used.values()):
        raise ValueError("the tokenizer's chat template does not render every content of this "
                         "conversation exactly once")
    pieces = [(values[int(part)], True) if i % 2 else (part, False) for i, part in enumerate(parts)]
    return chat.encode_masked(tokenizer, _assistant_mask(pieces))


def _hold_strings(value, hold):
    """``value`` with every string leaf replaced by a placeholder of its JSON-escaped text (the
    templates write arguments with ``tojson``)."""
    if isinstance(value, str):
        return hold(value, escaped=True)
    if isinstance(value, dict):
        return {k: _hold_strings(v, hold) for k, v in value.items()}
    if isinstance(value, list):
        return [_hold_strings(v, hold) for v in value]
    return value


def _marker(text: str) -> str:
    while True:
        marker = f"@@data{secrets.token_hex(4)}@@"
        if marker not in text:
            return marker


_TURN_MARKUP = re.compile(f"({re.escape(_ASSISTANT_HEADER)}|{re.escape(chat.IM_END)})")


def _assistant_mask(pieces: list[tuple[str, bool]]) -> list[tuple[str, bool, int]]:
    """Loss mask per piece: 1 from after an assistant header of the markup through the
    ``<|im_end|>`` that closes it. Only markup pieces open or close a turn."""
    out, inside = [], 0
    for text, is_data in pieces:
        if is_data:
            out.append((text, True, inside))
            continue
        for i, part in enumerate(_TURN_MARKUP.split(text)):
            if i % 2 == 0:
                if part:
                    out.append((part, False, inside))
            elif part == _ASSISTANT_HEADER:
                out.append((part, False, 0))
                inside = 1
            else:
                out.append((part, False, inside))
                inside = 0
    return out
