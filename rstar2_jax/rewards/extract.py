"""Find the final answer in a model response: the boxes of its last `<answer>` block.

The reward (docs/verifier.md) reads only boxed answers. A response may box intermediate results
while reasoning, and tool outputs are part of the decoded trajectory, so the boxes inside the
model's final `<answer>` block are the answer, all of them: `\\boxed{1}, \\boxed{2}` states
one answer in two parts (how the parts combine is the verifier's business, `verify.py`).

A response without an `<answer>` block, or whose last block boxes nothing, falls back to the
last box of the whole text together with the boxes just before it that are joined to it by
list glue only (`, `, ` and `, `$ or $`, `x_2 = `): "so $x_1 = \\boxed{2}$, $x_2 = \\boxed{3}$"
is one two-part answer, while "I first got \\boxed{3}, but fixing the sign: \\boxed{5}" answers 5.

Everything here is one left-to-right pass (linear time): the text is hostile, and a response of
thousands of unclosed `\\boxed{` must cost no more than reading it.
"""

import re

_ANSWER_OPEN = "<answer>"
_ANSWER_CLOSE = "</answer>"
# One scanner token: a box macro (`\boxedfoo` is a different macro), any other escape (so `\{`
# and `\}`, set braces, are content, not grouping), or a grouping brace.
_TOKEN = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])|\\.|[{}]", re.DOTALL)
_SPACE = re.compile(r"\s*")
# `\boxed 42`: TeX would box one token, but a model writing this means the whole number.
_BARE_CONTENT = re.compile(r"[^\s$]*")
# What may stand between two boxes of one answer: spacing, math delimiters, commas, `and`/`or`
# (bare or in `\text{}`), alignment, and a name being given a value (`x_2 =`, `y=`).
_MAX_GLUE_CHARS = 80
_GLUE = re.compile(
    r"(?:\s|\$|\\[()\[\],;:! ]|\\\\|\\q?quad(?![A-Za-z])|[,;&]|\b(?:and|or)\b"
    r"|\\(?:text|textrm|mbox)\{\s*(?:and|or)?\s*,?\s*\}"
    r"|[A-Za-z](?:_\{?\w+\}?)?\s*=)*+"
)


def _boxes(text: str, start: int, end: int) -> list[tuple[int, int, str]]:
    """The outermost boxes in `text[start:end]` as (start, end, content) spans, in order.

    A box inside a box is part of the outer box's content. A box whose braces never close
    (a truncated response) is no box.
    """
    boxes: list[tuple[int, int, str]] = []
    depth = 0  # brace depth, never below zero (a stray `}` closes nothing)
    box_start = box_open = box_depth = None  # the outermost box being read
    pos = start
    while (match := _TOKEN.search(text, pos, end)) is not None:
        token, pos = match.group(0), match.end()
        if token == "{":
            depth += 1
        elif token == "}":
            depth = max(depth - 1, 0)
            if box_depth is not None and depth == box_depth:
                boxes.append((box_start, pos, text[box_open + 1 : match.start()]))
                box_start = box_open = box_depth = None
        elif token[1:] in ("boxed", "fbox") and box_depth is None:
            after = _SPACE.match(text, pos, end).end()
            if after < end and text[after] == "{":
                box_start, box_open, box_depth = match.start(), after, depth
                depth, pos = depth + 1, after + 1
            elif after > pos:
                content = _BARE_CONTENT.match(text, after, end)
                boxes.append((match.start(), content.end(), content.group(0)))
                pos = content.end()
    return boxes


def _last_answer_block(text: str) -> tuple[int, int] | None:
    """The span of the last `<answer>` block's text; an unclosed block runs to the end."""
    start = text.rfind(_ANSWER_OPEN)
    if start < 0:
        return None
    start += len(_ANSWER_OPEN)
    end = text.find(_ANSWER_CLOSE, start)
    return start, len(text) if end < 0 else end


def _last_group(text: str, boxes: list[tuple[int, int, str]]) -> list[tuple[int, int, str]]:
    """The last box and the boxes before it joined to it by list glue only."""
    first = len(boxes) - 1
    while first > 0:
        gap_start, gap_end = boxes[first - 1][1], boxes[first][0]
        if gap_end - gap_start > _MAX_GLUE_CHARS:
            break
        if _GLUE.fullmatch(text, gap_start, gap_end) is None:
            break
        first -= 1
    return boxes[first:]


def extract_boxes(text: str) -> tuple[str, ...]:
    """The boxed parts of the final answer of `text`, stripped, in order; empty if none.

    The boxes are those of the last `<answer>...</answer>` block (an unclosed block runs to the
    end of the text); if it has none, the last box of the text and the boxes joined to it by
    list glue (see the module docstring). Reads `\\boxed{...}` (nested and escaped braces
    allowed), `\\boxed x` and `\\fbox{...}`; empty boxes state nothing and are dropped.
    """
    block = _last_answer_block(text)
    boxes = _boxes(text, *block) if block is not None else []
    if not boxes:
        boxes = _boxes(text, 0, len(text))
        boxes = _last_group(text, boxes) if boxes else []
    return tuple(content for _, _, raw in boxes if (content := raw.strip()))


def extract_answer(text: str) -> str | None:
    """The final answer of `text` as one string, or None if nothing is boxed.

    The boxes of `extract_boxes` joined by ", " (one box: its content). For display; the reward
    reads the boxes themselves, since how several boxes combine depends on the reference.
    """
    return ", ".join(extract_boxes(text)) or None
