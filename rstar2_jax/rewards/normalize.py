"""Rule-based normaliser: rewrite an answer string into a canonical LaTeX-ish form.

Two answers whose normal forms are equal strings are equivalent; the normal form is also the
input of the exact-number parser (`exact.py`). Every rule removes notation that does not change
the mathematical value: delimiters, spacing, font and text wrappers, thousands separators,
units, degree and percent signs, and a leading `x =`.

Percent signs are dropped rather than divided by 100 because "what percent ..." problems state
the gold answer as the number of percent (MATH convention): `25\\%` answers gold `25`.
"""

import re

# Commands that only change spacing, sizing or style.
_NOISE = re.compile(
    r"\\(?:left|right|big|Big|bigg|Bigg|displaystyle|textstyle|limits)(?![A-Za-z])"
    r"|\\[,;:! ]|~|\\?\$|\\\(|\\\)|\\\[|\\\]|\*\*"
)
# Wrappers whose argument is kept as plain content.
_WRAPPER = re.compile(
    r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mathit|mbox|operatorname)\s*\{"
)
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°")
_PERCENT = re.compile(r"\\?%")
_THOUSANDS = re.compile(r"^[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
# `x = 5`, `n_1 = 5`, `f(3) = 5`: keep the value. Only one `=`, so equations stay intact.
_LEADING_NAME = re.compile(r"^[A-Za-z](?:_\{?\w+\}?)?(?:\([^()=]*\))?=(?=[^=]+$)")
_UNIT_WORDS = (
    "square units|sq units|units?|degrees?|cm|mm|km|m|meters?|metres?|centimeters?|kilometers?"
    "|inches|inch|in|feet|foot|ft|yards?|miles?|mph|seconds?|sec|s|minutes?|min|hours?|hrs?|days?"
    "|weeks?|months?|years?|dollars?|cents?|grams?|g|kg|pounds?|lbs?|liters?|ml|ways|people"
)
# A unit is stripped only when it follows a number or closing brace after a space (as left by
# `10\\text{ cm}`), so a variable such as the `x` in `2x` is never taken for a unit.
_TRAILING_UNIT = re.compile(
    rf"(?<=[\d}}])\s+(?:{_UNIT_WORDS})(?:\s*\^\s*\{{?\d\}}?)?\.?$"
)
# `\frac12` and `\sqrt2`: TeX takes single-character arguments.
_BARE_FRAC = re.compile(r"\\frac(\d)(\d)")
_BARE_SQRT = re.compile(r"\\sqrt(\d)")


def _unwrap(text: str) -> str:
    """Replace each `\\text{...}`-style wrapper by its content (nested braces respected)."""
    while (match := _WRAPPER.search(text)) is not None:
        depth, end = 1, match.end()
        while end < len(text) and depth:
            if text[end] == "\\":
                end += 2
                continue
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            end += 1
        if depth:  # unbalanced: leave the rest as is rather than guess
            return text
        text = text[: match.start()] + text[match.end() : end - 1] + text[end:]
    return text


def normalize_answer(answer: str) -> str:
    """The canonical form of `answer` (a boxed answer's content); may be the empty string."""
    text = answer.strip()
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = text.replace("{,}", "")  # `1{,}000`: a thousands separator in TeX
    text = _unwrap(text)
    text = _NOISE.sub(" ", text)
    text = _DEGREES.sub("", text)
    text = _PERCENT.sub("", text)
    text = text.strip().rstrip(".").strip()
    text = _TRAILING_UNIT.sub("", text)
    text = _BARE_FRAC.sub(r"\\frac{\1}{\2}", text)
    text = _BARE_SQRT.sub(r"\\sqrt{\1}", text)
    text = re.sub(r"\s+", "", text)
    if _THOUSANDS.match(text):
        text = text.replace(",", "")
    return _LEADING_NAME.sub("", text)
