"""The chat formats at the token level: prompts, tool calls, tool responses, conversations.

A trajectory is a flat list of token ids built by appending, never by re-tokenizing text:

    encode_prompt(question)                     system turn, user turn, "<|im_start|>assistant\\n<reason>"
    + model tokens ... <|im_end|>               assistant turn 1 (loss mask 1)
    + encode_tool_response(text)                "\\n<|im_start|>user\\n<tool_response>\\n...\\n</tool_response>
                                                 <|im_end|>\\n<|im_start|>assistant\\n<reason>" (loss mask 0)
    + model tokens ... <|im_end|>               assistant turn 2 (loss mask 1)
    ...                                          until a turn has no <tool_call>

The markup is Qwen's (``<|im_start|>role\\n ... <|im_end|>\\n``). A `ChatFormat` fixes the rest:
the system prompt and tool schema, the text around the question, how tool calls and tool turns
are laid out and how long a tool response may be. Two are built in: ``rstar2`` (ours, the
paper's prompt; it keeps Qwen's ``<|im_end|>\\n`` before a tool turn, so the text of a
trajectory is the ordinary chat rendering of its messages) and ``rstar2_released`` (the released
rStar2-Agent checkpoint's: its tool name ``python_code_with_standard_io`` and schema,
newline-padded tool calls, tool turns glued to the model's ``<|im_end|>``, tool output cut to
256 characters in the middle).

Text from outside the model (questions, tool output, SFT contents) is data: it is encoded with
special-token parsing off, so markup inside it never becomes a control token (`encode_pieces`).

A tool call is a JSON object inside ``<tool_call></tool_call>``:
``{"name": "execute_python_code_with_standard_io", "arguments": {"code": "...", "input": ""}}``.
Only the first call of a turn is executed, as in rStar2 (verl's ``max_parallel_calls = 1``).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import json
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

# The paper's tool schema (Fig. 3): one function, `code` and stdin `input`, both strings.
TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Execute Python code with the given standard input and return its "
        "standard output, standard error and execution status.",
        "parameters": {
            "type": "object",
            "properties": {
                "code": {"type": "string", "description": "The Python program to run."},
                "input": {"type": "string", "description": "Text fed to the program's standard input."},
            },
            "required": ["code", "input"],
        },
        "return": {"type": "string", "description": "The execution result."},
    },
}

_RSTAR2_INSTRUCTION = (
    "A conversation between User and Assistant. The User asks a question, and the Assistant "
    "solves it. The Assistant first thinks about the reasoning process in the mind and then "
    "provides the User with the answer. The reasoning process is enclosed within <reason> "
    "</reason> and answer is enclosed within <answer> </answer> tags, respectively, i.e., "
    "<reason> reasoning process here </reason> <answer> answer here </answer>."
)


def _tools_block(schema: dict) -> str:
    """Qwen/Hermes "# Tools" block, worded as in the released rStar2 chat template."""
    return ("\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            + json.dumps(schema, ensure_ascii=False)
            + "\n</tools>\n\nFor each function call, return a json object with function name and "
            "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


RSTAR2_SYSTEM_PROMPT = _RSTAR2_INSTRUCTION + _tools_block(TOOL_SCHEMA)

RSTAR2_USER_TEMPLATE = (
    "You must put your answer inside <answer> </answer> tags, i.e., <answer> answer here "
    "</answer>. And your final answer will be extracted automatically by the \\boxed{} tag.\n"
    "This is the problem:\n{question}"
)


@dataclasses.dataclass(frozen=True)
class ChatFormat:
    """Everything a policy's token format fixes beyond Qwen's chat markup. Defaults are ours
    (the paper's prompt); ``RELEASED_FORMAT`` is the released rStar2-Agent checkpoint's.

    Attributes:
      system_prompt: content of the system turn (instructions and the tool schema).
      user_template: content of a user turn; must contain ``{question}`` exactly once.
      tool_name: the one tool's function name; calls to any other name are malformed.
      tool_call_open, tool_call_close: written around the call's JSON when a tool call is
        rendered from a structured message (SFT data); the parser accepts any whitespace.
      turn_separator: text between the model's ``<|im_end|>`` and the turn the host appends
        (Qwen's ``"\n"``; the released agent loop glued the tool turn on directly).
      tool_response_chars: the tool response shown to the model is cut to its first and last
        ``tool_response_chars // 2`` characters around ``...(truncated)...`` when it is longer
        (verl's middle truncation); None leaves it as the sandbox rendered it.
    """

    system_prompt: str = RSTAR2_SYSTEM_PROMPT
    user_template: str = RSTAR2_USER_TEMPLATE
    tool_name: str = TOOL_NAME
    tool_call_open: str = TOOL_CALL_START
    tool_call_close: str = TOOL_CALL_END
    turn_separator: str = "\n"
    tool_response_chars: int | None = None

    def __post_init__(self):
        if self.user_template.count("{question}") != 1:
            raise ValueError("ChatFormat.user_template must contain '{question}' exactly once")
        if TOOL_CALL_START not in self.tool_call_open or TOOL_CALL_END not in self.tool_call_close:
            raise ValueError("ChatFormat.tool_call_open/close must contain the tool-call tags")
        if self.tool_response_chars is not None and self.tool_response_chars < 2:
            raise ValueError("ChatFormat.tool_response_chars must be >= 2 or None")

    def user_text(self, question: str) -> str:
        return self.user_template.replace("{question}", question)

    def prompt_text(self, question: str) -> str:
        """The prompt as text, ending with the prefilled ``<|im_start|>assistant\\n<reason>``."""
        return "".join(text for text, _ in self.prompt_pieces(question))

    def prompt_pieces(self, question: str) -> list[tuple[str, bool]]:
        """The prompt as ``(text, is_data)`` pieces: the question is data (see `encode_pieces`)."""
        head, tail = self.user_template.split("{question}")
        return [(f"{IM_START}system\n{self.system_prompt}{IM_END}\n{IM_START}user\n{head}", False),
                (question, True), (f"{tail}{IM_END}\n{GENERATION_PROMPT}", False)]

    def tool_call_text(self, name: str, arguments: dict) -> str:
        """A tool call as this format writes it (``arguments`` is the JSON object)."""
        call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"{self.tool_call_open}{call}{self.tool_call_close}"

    def truncate(self, response_text: str) -> str:
        """The tool response as the model is shown it (see ``tool_response_chars``)."""
        n = self.tool_response_chars
        if n is None or len(response_text) <= n:
            return response_text
        return response_text[: n // 2] + "...(truncated)..." + response_text[len(response_text) - n // 2:]

    def tool_turn_pieces(self, responses: Sequence[str]) -> list[tuple[str, bool]]:
        """The user turn carrying tool responses (one per call; the sampler makes one) and the
        next assistant turn's prefill, appended after the model's ``<|im_end|>``."""
        pieces = [(f"{self.turn_separator}{IM_START}user", False)]
        for text in responses:
            pieces += [(f"\n{TOOL_RESPONSE_START}", False), ("\n" + self.truncate(text) + "\n", True),
                       (TOOL_RESPONSE_END, False)]
        return pieces + [(f"{IM_END}\n{GENERATION_PROMPT}", False)]


# The released checkpoint's tool (its tool config): same parameters, its own name and wording.
RELEASED_TOOL_NAME = "python_code_with_standard_io"
RELEASED_TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": RELEASED_TOOL_NAME,
        "description": "Execute Python code with standard input and capture standard output. This "
        "function takes a Python code string and an input string, provides the input string "
        "through standard input (stdin) to the code, and captures and returns any output produced "
        "through standard output (stdout). If the executed code raises an exception, the error "
        "message will be captured and returned instead.",
        "parameters": {
            "type": "object",
            "properties": {
                "code": {"type": "string", "description": "A string containing Python code to be "
                         "executed. The code can read from standard input using the input() function."},
                "input": {"type": "string", "description": "A string that will be provided as "
                          "standard input to the code when it calls input()."},
            },
            "required": ["code", "input"],
        },
    },
}

# The released rStar2-Agent checkpoint's format: its chat template's system turn (the
# instruction, then the tool schema on its own line), newline-padded tool calls, tool
# responses glued to the model's <|im_end|> (its agent loop), and verl's 256-character middle
# truncation of tool output. User turns carry the same instruction prefix as ours.
RELEASED_FORMAT = ChatFormat(
    system_prompt=_RSTAR2_INSTRUCTION + _tools_block(RELEASED_TOOL_SCHEMA),
    tool_name=RELEASED_TOOL_NAME,
    tool_call_open=f"\n{TOOL_CALL_START}\n",
    tool_call_close=f"\n{TOOL_CALL_END}",
    turn_separator="",
    tool_response_chars=256,
)

# The formats a config can name (`ModelSource.chat_format`); a package adds its own with
# `register_format` when it is imported.
_FORMATS: dict[str, ChatFormat] = {"rstar2": ChatFormat(), "rstar2_released": RELEASED_FORMAT}


def register_format(name: str, fmt: ChatFormat) -> None:
    """Makes ``fmt`` the chat format that configs name ``name`` (``model.chat_format``).

    Registering the same format under its name again does nothing; another format under a taken
    name is an error, so that a name always means one prompt.
    """
    if _FORMATS.setdefault(name, fmt) != fmt:
        raise ValueError(f"chat format {name!r} is already registered as a different format")


def format_names() -> tuple[str, ...]:
    """The registered chat format names, sorted."""
    return tuple(sorted(_FORMATS))


def get_format(name: str) -> ChatFormat:
    """The chat format registered as ``name``."""
    if name not in _FORMATS:
        raise ValueError(f"unknown chat format {name!r}; registered: {', '.join(format_names())}")
    return _FORMATS[name]


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


def encode_prompt(tokenizer: Tokenizer, question: str, fmt: ChatFormat = ChatFormat()) -> list[int]:
    """Token ids of the prompt; generation continues right after ``<reason>``. The question is
    data: markup inside it stays text."""
    return encode_pieces(tokenizer, fmt.prompt_pieces(question))


def tool_response_text(response_text: str, fmt: ChatFormat = ChatFormat()) -> str:
    """The scaffold appended after the model's ``<|im_end|>``: a user turn, then a new assistant turn."""
    return "".join(text for text, _ in fmt.tool_turn_pieces([response_text]))


def encode_tool_response(tokenizer: Tokenizer, response_text: str,
                         fmt: ChatFormat = ChatFormat()) -> list[int]:
    """Token ids of the tool-response scaffold (loss mask 0), see ``tool_response_text``. The
    response is data: markup a program prints stays text."""
    return encode_pieces(tokenizer, fmt.tool_turn_pieces([response_text]))


def format_tool_call(code: str, stdin: str = "", name: str = TOOL_NAME,
                     fmt: ChatFormat = ChatFormat()) -> str:
    """A well-formed tool call as the model should write it."""
    return fmt.tool_call_text(name, {"code": code, "input": stdin})


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """The first tool call of an assistant turn.

    Attributes:
      code: the Python program ("" when ``error`` is set).
      stdin: text for the program's standard input.
      error: why the call is malformed (bad JSON, unknown tool, missing ``code``), or None. A
        malformed call is not executed: the model is shown the error as a failed tool response,
        and it counts as an erroneous tool call for GRPO-RoC.
    """

    code: str
    stdin: str
    error: str | None = None


_CALL_RE = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)(" + re.escape(TOOL_CALL_END) + r"|$)", re.DOTALL)


def parse_tool_call(turn_text: str, tool_name: str = TOOL_NAME) -> ToolCall | None:
    """Parse the first tool call of an assistant turn.

    Args:
      turn_text: the decoded text of one assistant turn (decode the turn's ids with special
        tokens kept, so the markup is visible).
      tool_name: the format's tool (``ChatFormat.tool_name``); any other name is malformed.

    Returns:
      None when the turn contains no ``<tool_call>`` (the trajectory ends); otherwise the first
      call, with ``error`` set if it is malformed (including a ``<tool_call>`` never closed).
    """
    match = _CALL_RE.search(turn_text)
    if match is None:
        return None
    if not match.group(2):
        return _malformed(f"the tool call has no closing {TOOL_CALL_END} tag")
    try:
        call = json.loads(match.group(1))
    except json.JSONDecodeError as e:
        return _malformed(f"failed to decode tool call: {e}")
    if not isinstance(call, dict) or not isinstance(call.get("arguments"), dict):
        return _malformed('a tool call must be a JSON object {"name": ..., "arguments": {...}}')
    if call.get("name") != tool_name:
        return _malformed(f"unknown tool {call.get('name')!r}; the only tool is {tool_name!r}")
    args = call["arguments"]
    if not isinstance(args.get("code"), str):
        return _malformed('the tool call needs a string argument "code"')
    stdin = args.get("input", "")
    if not isinstance(stdin, str):
        return _malformed('the tool argument "input" must be a string')
    return ToolCall(code=args["code"], stdin=stdin)


def _malformed(error: str) -> ToolCall:
    return ToolCall(code="", stdin="", error=error)


def malformed_call_response(call: ToolCall) -> str:
    """The tool response shown for a malformed call, in the sandbox's failure layout."""
    if call.error is None:
        raise ValueError("malformed_call_response needs a call with an error")
    return f"Tool call failure\nreason: {call.error}"


_ANSWER_RE = re.compile(re.escape(ANSWER_START) + r".*?" + re.escape(ANSWER_END), re.DOTALL)


def count_answer_blocks(text: str) -> int:
    """Number of closed ``<answer>...</answer>`` blocks (GRPO-RoC's format penalty counts them)."""
    return len(_ANSWER_RE.findall(text))


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


def call_json(call: dict) -> str:
    """A structured tool call ``{"name", "arguments"}`` as the JSON inside ``<tool_call>``."""
    return json.dumps({"name": call["name"], "arguments": call["arguments"]}, ensure_ascii=False)


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
