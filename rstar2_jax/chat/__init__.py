"""The chat formats at the token level: prompts, tool calls, tool responses, conversations.

    markup.py        Qwen's markup tokens; text -> ids, where data never becomes markup
    formats.py       `ChatFormat` (prompt, tool schema, tool-turn layout), the registry, prompts
    tool_calls.py    parsing and rendering the JSON tool call of a turn
    conversation.py  SFT conversations -> ids and loss mask, as the sampler would write them

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

from rstar2_jax.chat.markup import (
    ANSWER_END,
    ANSWER_START,
    ENDOFTEXT,
    GENERATION_PROMPT,
    IM_END,
    IM_START,
    REASON_END,
    REASON_START,
    TOOL_CALL_END,
    TOOL_CALL_START,
    TOOL_NAME,
    TOOL_RESPONSE_END,
    TOOL_RESPONSE_START,
    Tokenizer,
    encode_masked,
    encode_pieces,
    special_tokens,
    token_id,
)
from rstar2_jax.chat.formats import (
    ChatFormat,
    RELEASED_FORMAT,
    RELEASED_TOOL_NAME,
    RELEASED_TOOL_SCHEMA,
    RSTAR2_SYSTEM_PROMPT,
    RSTAR2_USER_TEMPLATE,
    TOOL_SCHEMA,
    count_answer_blocks,
    encode_prompt,
    encode_tool_response,
    format_names,
    get_format,
    register_format,
    tool_response_text,
)
from rstar2_jax.chat.tool_calls import (
    ToolCall,
    call_json,
    format_tool_call,
    malformed_call_response,
    parse_tool_call,
)
from rstar2_jax.chat.conversation import (
    encode_conversation,
    normalize_messages,
)

__all__ = [
    "ANSWER_END",
    "ANSWER_START",
    "ChatFormat",
    "ENDOFTEXT",
    "GENERATION_PROMPT",
    "IM_END",
    "IM_START",
    "REASON_END",
    "REASON_START",
    "RELEASED_FORMAT",
    "RELEASED_TOOL_NAME",
    "RELEASED_TOOL_SCHEMA",
    "RSTAR2_SYSTEM_PROMPT",
    "RSTAR2_USER_TEMPLATE",
    "TOOL_CALL_END",
    "TOOL_CALL_START",
    "TOOL_NAME",
    "TOOL_RESPONSE_END",
    "TOOL_RESPONSE_START",
    "TOOL_SCHEMA",
    "Tokenizer",
    "ToolCall",
    "call_json",
    "count_answer_blocks",
    "encode_conversation",
    "encode_masked",
    "encode_pieces",
    "encode_prompt",
    "encode_tool_response",
    "format_names",
    "format_tool_call",
    "get_format",
    "malformed_call_response",
    "normalize_messages",
    "parse_tool_call",
    "register_format",
    "special_tokens",
    "token_id",
    "tool_response_text",
]
