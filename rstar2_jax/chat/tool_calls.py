"""Tool calls as the model writes them: a JSON object inside ``<tool_call></tool_call>``,
parsed from a turn's text (`parse_tool_call`) or rendered (`format_tool_call`, `call_json`).
Only the first call of a turn runs, as in rStar2 (verl's ``max_parallel_calls = 1``); a
malformed call is not run, and the model is shown why (`malformed_call_response`)."""
from __future__ import annotations

import dataclasses
import json
import re

from rstar2_jax.chat.formats import ChatFormat
from rstar2_jax.chat.markup import TOOL_CALL_END, TOOL_CALL_START, TOOL_NAME


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


def call_json(call: dict) -> str:
    """A structured tool call ``{"name", "arguments"}`` as the JSON inside ``<tool_call>``."""
    return json.dumps({"name": call["name"], "arguments": call["arguments"]}, ensure_ascii=False)
