"""Conversations (SFT data) encoded token for token as the sampler would have produced them: the
standard chat layout checked (`normalize_messages`), then ids and a loss mask
(`encode_conversation`)."""
from __future__ import annotations

import json
from typing import Sequence

from rstar2_jax.chat.formats import ChatFormat
from rstar2_jax.chat.markup import GENERATION_PROMPT, IM_END, IM_START, Tokenizer, encode_masked
from rstar2_jax.chat.tool_calls import call_json


def encode_conversation(
    tokenizer: Tokenizer, messages: Sequence[dict], fmt: ChatFormat = ChatFormat()
) -> tuple[list[int], list[int]]:
    """Token ids and loss mask of a conversation rendered in ``fmt``, as the sampler builds it.

    Args:
      messages: the chat layout of `normalize_messages`. A system message replaces
        ``fmt.system_prompt``. A user content is the bare question (``fmt.user_template`` goes
        around it). An assistant content is the exact text after the prefilled ``<reason>`` up
        to (not including) ``<|im_end|>``; its ``tool_calls`` are written after it in ``fmt``'s
        layout. Consecutive tool messages make one tool turn. Contents are data: markup in
        them stays text.

    Returns:
      ``(ids, loss_mask)``, two lists of equal length ``[seq]``; the mask is 1 on the tokens the
      model generates (assistant content, its tool calls and its ``<|im_end|>``), 0 on the
      prompt, the prefilled ``<reason>`` and the tool turns.
    """
    messages = normalize_messages(messages)
    head, tail = fmt.user_template.split("{question}")
    if messages[0]["role"] == "system":
        system = [(messages[0]["content"], True, 0)]
    else:
        system = [(fmt.system_prompt, False, 0)]
    pieces: list[tuple[str, bool, int]] = []  # (text, is_data, loss mask)
    for i, m in enumerate(messages):
        role = m["role"]
        if role == "user":
            if pieces:
                pieces.append((fmt.turn_separator, False, 0))
            else:
                pieces += [(f"{IM_START}system\n", False, 0), *system, (f"{IM_END}\n", False, 0)]
            pieces += [(f"{IM_START}user\n{head}", False, 0), (m["content"], True, 0),
                       (f"{tail}{IM_END}\n{GENERATION_PROMPT}", False, 0)]
        elif role == "assistant":
            pieces.append((m["content"], True, 1))
            for call in m["tool_calls"]:
                pieces += [(fmt.tool_call_open, False, 1), (call_json(call), True, 1),
                           (fmt.tool_call_close, False, 1)]
            pieces.append((IM_END, False, 1))
        elif role == "tool" and messages[i - 1]["role"] != "tool":
            responses = [t["content"] for t in _tool_run(messages, i)]
            pieces += [(text, is_data, 0) for text, is_data in fmt.tool_turn_pieces(responses)]
    return encode_masked(tokenizer, pieces)


def _tool_run(messages: Sequence[dict], start: int) -> list[dict]:
    end = start
    while end < len(messages) and messages[end]["role"] == "tool":
        end += 1
    return list(messages[start:end])


_NEXT_ROLES = {None: ("system", "user"), "system": ("user",), "user": ("assistant",),
               "assistant": ("user", "tool"), "tool": ("tool", "assistant")}


def normalize_messages(messages) -> list[dict]:
    """The standard chat layout, checked and normalized; raises ValueError saying what is wrong.

    Layout: an optional system message, then user turns, each answered by an assistant turn;
    an assistant turn may call tools, each answered by a ``tool`` message, after which the
    assistant continues. The last message is the assistant's. Contents are strings (an
    assistant with ``tool_calls`` may have none). ``tool_calls`` are OpenAI / Hugging Face
    style, ``[{"type": "function", "function": {"name", "arguments"}}]`` or
    ``[{"name", "arguments"}]``, with the arguments an object or its JSON text.

    Returns copies ``{"role", "content", "tool_calls"}`` (tool_calls ``[{"name", "arguments"}]``
    with object arguments; empty for non-assistant messages).
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    out, previous = [], None
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"message {i} is a {type(m).__name__}, not an object")
        role = m.get("role")
        if role not in _NEXT_ROLES[previous]:
            roles = [x.get("role") if isinstance(x, dict) else None for x in messages]
            raise ValueError(f"message {i} has role {role!r} after {previous!r}; roles {roles} do not "
                             f"follow system?, (user, assistant, (tool+, assistant)*)+")
        calls = [_normalize_call(c, i) for c in m.get("tool_calls") or []]
        if calls and role != "assistant":
            raise ValueError(f"message {i}: only assistant messages may have tool_calls")
        content = m.get("content")
        if content is None and calls:
            content = ""
        if not isinstance(content, str):
            raise ValueError(f"message {i}: content must be a string, got {type(content).__name__}")
        out.append({"role": role, "content": content, "tool_calls": calls})
        previous = role
    if previous != "assistant":
        raise ValueError(f"the last message must be the assistant's, not {previous!r}")
    return out


def _normalize_call(call, i: int) -> dict:
    if not isinstance(call, dict):
        raise ValueError(f"message {i}: a tool call must be an object, got {type(call).__name__}")
    function = call.get("function", call)
    if not isinstance(function, dict):
        raise ValueError(f"message {i}: a tool call's function must be an object, got {call!r}")
    name, arguments = function.get("name"), function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise ValueError(f"message {i}: tool call arguments are not valid JSON ({e})") from None
    if not isinstance(name, str) or not isinstance(arguments, dict):
        raise ValueError(f"message {i}: a tool call needs a string name and object arguments, got {call!r}")
    return {"name": name, "arguments": arguments}
