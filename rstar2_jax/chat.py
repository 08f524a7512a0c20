"""The rStar2-Agent chat format at the token level: prompts, tool calls, tool responses.

A trajectory is a flat list of token ids built by appending, never by re-tokenizing text:

    encode_prompt(question)                     system turn, user turn, "<|im_start|>assistant\\n<reason>"
    + model tokens ... <|im_end|>               assistant turn 1 (loss mask 1)
    + encode_tool_response(text)                "\\n<|im_start|>user\\n<tool_response>\\n...\\n</tool_response>
                                                 <|im_end|>\\n<|im_start|>assistant\\n<reason>" (loss mask 0)
    + model tokens ... <|im_end|>               assistant turn 2 (loss mask 1)
    ...                                          until a turn has no <tool_call>

The markup is Qwen's (``<|im_start|>role\\n ... <|im_end|>\\n``). One deliberate difference from
the released rStar2 code: it glues the tool turn straight onto the generated ``<|im_end|>``
(no newline); we keep Qwen's ``<|im_end|>\\n`` everywhere, so the text of a trajectory is exactly
the ordinary chat rendering of its messages.

A tool call is a JSON object inside ``<tool_call></tool_call>``:
``{"name": "execute_python_code_with_standard_io", "arguments": {"code": "...", "input": ""}}``.
Only the first call of a turn is executed, as in rStar2 (verl's ``max_parallel_calls = 1``).
"""
from __future__ import annotations

import dataclasses
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

# Qwen/Hermes "# Tools" block, worded as in the released rStar2 chat template.
_TOOLS_BLOCK = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(TOOL_SCHEMA)
    + "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)

RSTAR2_SYSTEM_PROMPT = _RSTAR2_INSTRUCTION + _TOOLS_BLOCK

RSTAR2_USER_TEMPLATE = (
    "You must put your answer inside <answer> </answer> tags, i.e., <answer> answer here "
    "</answer>. And your final answer will be extracted automatically by the \\boxed{} tag.\n"
    "This is the problem:\n{question}"
)


@dataclasses.dataclass(frozen=True)
class ChatFormat:
    """The text around a question. Defaults are rStar2's; a small model may use shorter ones.

    Attributes:
      system_prompt: content of the system turn (instructions and the tool schema).
      user_template: content of the user turn; must contain ``{question}`` exactly once.
    """

    system_prompt: str = RSTAR2_SYSTEM_PROMPT
    user_template: str = RSTAR2_USER_TEMPLATE

    def __post_init__(self):
        if self.user_template.count("{question}") != 1:
            raise ValueError("ChatFormat.user_template must contain '{question}' exactly once")

    def prompt_text(self, question: str) -> str:
        """The prompt as text, ending with the prefilled ``<|im_start|>assistant\\n<reason>``."""
        user = self.user_template.replace("{question}", question)
        return (
            f"{IM_START}system\n{self.system_prompt}{IM_END}\n"
            f"{IM_START}user\n{user}{IM_END}\n"
            f"{IM_START}assistant\n{REASON_START}"
        )


# The formats a config can name (`ModelSource.chat_format`); a package adds its own with
# `register_format` when it is imported.
_FORMATS: dict[str, ChatFormat] = {"rstar2": ChatFormat()}


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

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


def token_id(tokenizer: Tokenizer, token: str) -> int:
    """Id of a markup token that the tokenizer must keep whole (e.g. ``IM_END``)."""
    ids = tokenizer.encode(token, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"tokenizer encodes {token!r} as {len(ids)} tokens {ids}; it must be one token")
    return ids[0]


def encode_prompt(tokenizer: Tokenizer, question: str, fmt: ChatFormat = ChatFormat()) -> list[int]:
    """Token ids of the prompt; generation continues right after ``<reason>``."""
    return tokenizer.encode(fmt.prompt_text(question), add_special_tokens=False)


def tool_response_text(response_text: str) -> str:
    """The scaffold appended after the model's ``<|im_end|>``: a user turn, then a new assistant turn."""
    return (
        f"\n{IM_START}user\n{TOOL_RESPONSE_START}\n{response_text}\n{TOOL_RESPONSE_END}{IM_END}\n"
        f"{IM_START}assistant\n{REASON_START}"
    )


def encode_tool_response(tokenizer: Tokenizer, response_text: str) -> list[int]:
    """Token ids of the tool-response scaffold (loss mask 0), see ``tool_response_text``."""
    return tokenizer.encode(tool_response_text(response_text), add_special_tokens=False)


def format_tool_call(code: str, stdin: str = "", name: str = TOOL_NAME) -> str:
    """A well-formed tool call as the model should write it."""
    call = {"name": name, "arguments": {"code": code, "input": stdin}}
    return f"{TOOL_CALL_START}{json.dumps(call)}{TOOL_CALL_END}"


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


def parse_tool_call(turn_text: str) -> ToolCall | None:
    """Parse the first tool call of an assistant turn.

    Args:
      turn_text: the decoded text of one assistant turn (decode the turn's ids with special
        tokens kept, so the markup is visible).

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
    if call.get("name") != TOOL_NAME:
        return _malformed(f"unknown tool {call.get('name')!r}; the only tool is {TOOL_NAME!r}")
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
    """Token ids and loss mask of a whole trajectory, identical to what the sampler builds.

    Args:
      messages: ``[user, assistant, (tool, assistant)*]`` as ``{"role", "content"}`` dicts. The
        user content is the bare question. An assistant content is the exact text after the
        prefilled ``<reason>`` up to (not including) ``<|im_end|>``; a tool content is the
        rendered tool output.

    Returns:
      ``(ids, loss_mask)``, two lists of equal length ``[seq]``; the mask is 1 on the tokens the
      model generates (assistant content and its ``<|im_end|>``), 0 on prompt and tool tokens.
    """
    _check_roles(messages)
    im_end = token_id(tokenizer, IM_END)
    ids = encode_prompt(tokenizer, messages[0]["content"], fmt)
    mask = [0] * len(ids)
    for message in messages[1:]:
        if message["role"] == "assistant":
            piece = tokenizer.encode(message["content"], add_special_tokens=False) + [im_end]
            mask += [1] * len(piece)
        else:
            piece = encode_tool_response(tokenizer, message["content"])
            mask += [0] * len(piece)
        ids += piece
    return ids, mask


def _check_roles(messages: Sequence[dict]) -> None:
    roles = [m.get("role") for m in messages]
    expected = ["user"] + ["assistant" if i % 2 == 0 else "tool" for i in range(len(roles) - 1)]
    if len(roles) < 2 or roles != expected or roles[-1] != "assistant":
        raise ValueError(f"messages must be user, assistant, (tool, assistant)*; got roles {roles}")
    for m in messages:
        if not isinstance(m.get("content"), str):
            raise ValueError(f"message content must be a string; got {m!r}")
