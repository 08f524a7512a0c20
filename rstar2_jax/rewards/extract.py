"""Find the final answer in a model response: the last `\\boxed{...}`, preferring `<answer>`.

The reward (DESIGN §2b) looks only at the boxed answer. A response may box intermediate
results while reasoning, and tool outputs are part of the decoded trajectory, so the box inside
the model's final `<answer>` block is the one that counts; a response without an `<answer>`
block (or with an answer block that boxes nothing) falls back to the last box anywhere.
"""

import re

# `\boxed` and `\fbox` draw the same box; `\boxedfoo` would be a different macro.
_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_ANSWER_OPEN = "<answer>"
_ANSWER_CLOSE = "</answer>"


def _braced(text: str, start: int) -> str | None:
    """The content of the brace group opening at `text[start] == "{"`, or None if unclosed.

    Escaped braces (`\\{`, `\\}`: set notation) are content, not grouping.
    """
    depth = 0
    i = start
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i]
        i += 1
    return None  # truncated response: the box never closed


def _boxed_contents(text: str) -> list[str]:
    """Contents of every well-formed box in `text`, in order of appearance."""
    contents = []
    for match in _BOX.finditer(text):
        rest = match.end()
        stripped = text[rest:].lstrip()
        offset = rest + len(text[rest:]) - len(stripped)
        if stripped.startswith("{"):
            content = _braced(text, offset)
        elif offset > rest:
            # `\boxed 42`: TeX would box one token, but a model writing this means the whole
            # number, so take everything up to the next space or math delimiter.
            content = re.match(r"[^\s$]*", stripped).group(0)
        else:
            content = None
        if content is not None:
            contents.append(content)
    return contents


def _last_answer_block(text: str) -> str | None:
    """The text of the last `<answer>` block; an unclosed block runs to the end of `text`."""
    start = text.rfind(_ANSWER_OPEN)
    if start < 0:
        return None
    start += len(_ANSWER_OPEN)
    end = text.find(_ANSWER_CLOSE, start)
    return text[start:] if end < 0 else text[start:end]


def extract_answer(text: str) -> str | None:
    """The stripped content of the final boxed answer in `text`, or None if nothing is boxed.

    Looks for `\\boxed{...}` (nested and escaped braces allowed), `\\boxed x` and `\\fbox{...}`.
    The last box inside the last `<answer>...</answer>` block wins; otherwise the last box in
    the whole text. An empty box counts as no answer.
    """
    block = _last_answer_block(text)
    candidates = _boxed_contents(block) if block is not None else []
    if not candidates:
        candidates = _boxed_contents(text)
    if not candidates:
        return None
    answer = candidates[-1].strip()
    return answer or None
