"""Chat formats: the system prompt and tool schema, the text around the question, the layout of
tool calls and tool turns (`ChatFormat`), the registry configs name them by
(``model.chat_format``), and the prompt and tool-turn ids a trajectory is built from."""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Sequence

from rstar2_jax.chat.markup import (
    ANSWER_END,
    ANSWER_START,
    GENERATION_PROMPT,
    IM_END,
    IM_START,
    TOOL_CALL_END,
    TOOL_CALL_START,
    TOOL_NAME,
    TOOL_RESPONSE_END,
    TOOL_RESPONSE_START,
    Tokenizer,
    encode_pieces,
)

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


_ANSWER_RE = re.compile(re.escape(ANSWER_START) + r".*?" + re.escape(ANSWER_END), re.DOTALL)


def count_answer_blocks(text: str) -> int:
    """Number of closed ``<answer>...</answer>`` blocks (GRPO-RoC's format penalty counts them)."""
    return len(_ANSWER_RE.findall(text))
