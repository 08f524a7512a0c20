"""Rule-based normaliser: rewrite an answer string into a canonical LaTeX-ish form.

Two answers whose normal forms are equal strings are equivalent; the normal form is also the
input of the exact-number parser (`exact.py`). Every rule removes notation that does not change
the mathematical value: delimiters, spacing, font and text wrappers, thousands separators,
units, degree and percent signs, and a leading `x =`. Lists are written one way: `1 or 2`,
`1 and 2` and `x=1, x=2` all become `1,2`.

Percent signs are dropped rather than divided by 100 because "what percent ..." problems state
the gold answer as the number of percent (MATH convention): `25\\%` answers gold `25`.

The text is the policy's, so every pattern here runs in time linear in its length: `tidy` first
makes each run of spacing (spaces, tabs, `\\,`, `\\;`, `\\quad`, `~`, ...) a single space, so
that no later pattern ever sees a long run of what it may skip (`1` + 2,000 spaces + `2` once
took more than 30 s in the list-word pattern, which backtracked cubically over the run).
"""

import functools
import re

# A run of spacing: whitespace and TeX's spacing commands. The alternatives start differently,
# so a run is matched in one pass. A line break `\\\\` is taken whole first, so that its second
# backslash is never read as the start of the control space `\\ `.
_SPACING_RUN = re.compile(
    r"(\\\\)|(?:\s|~|\\[,;:! ]|\\(?:q?quad|enspace|thinspace|medspace|thickspace)(?![A-Za-z]))+"
)
# `\\begin{...}`/`\\end{...}` (inside them, `\\\\` separates matrix rows) and line breaks.
_LINE_BREAK_TOKEN = re.compile(r"\\begin(?![A-Za-z])|\\end(?![A-Za-z])|\\\\|\\.", re.DOTALL)
# Commands that only change sizing or style, and math delimiters.
_NOISE = re.compile(
    r"\\(?:left|right|big|Big|bigg|Bigg|displaystyle|textstyle|limits)(?![A-Za-z])"
    r"|\\?\$|\\\(|\\\)|\\\[|\\\]|\*\*"
)
# Wrappers whose argument is kept as plain content; a box inside a box is the same answer.
_WRAPPER = re.compile(
    r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mathit|mbox|operatorname|boxed|fbox)\s*\{"
)
_WRAPPER_TOKEN = re.compile(_WRAPPER.pattern + r"|\\.|[{}]", re.DOTALL)
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°")
_PERCENT = re.compile(r"\\?%")
_THOUSANDS = re.compile(r"^[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
# A comma with spacing beside it separates the values of a list (`1, 100` is two solutions); a
# thousands separator has none (`1,100`), or TeX's `{,}` or `,\!` (`10,\!000`, MATH's style).
_LIST_COMMA = re.compile(r"\s,|,\s")
_TEX_THOUSANDS = re.compile(r"(?<=\d),\\!(?=\d)")
# A mixed number `2\frac{1}{4}` (MATH writes them so) is 2 + 1/4, not the product 2 * 1/4: an
# integer right before a proper fraction of integers, not itself the end of an exponent, a
# subscript, a decimal or a word. The fraction's integers are compared as digit strings (any
# length).
_MIXED_NUMBER = re.compile(
    r"(?<![\w.^_}\])])(\d+) ?\\[dt]?frac(?:\{(\d+)\}\{(\d+)\}|(\d)(\d))"
)
# `x = 5`, `n_1 = 5`, `f(3) = 5`, `(x,y) = (1,2)`: keep the value. Only one `=`, so equations
# stay intact.
_NAME_ONLY = r"(?:[A-Za-z](?:_\{?\w+\}?)?(?:\([^()=]*\))?|\([A-Za-z](?:,[A-Za-z])+\))"
_NAME = _NAME_ONLY + "="
_LEADING_NAME = re.compile(rf"^{_NAME}(?=[^=]+$)")
_NAMED_PART = re.compile(rf"({_NAME})([^=]+)")
# `1 or 2`, `1, 2, and 3`, `x=1 \\text{ or } x=2`: a list of answers.
_LIST_WORD = re.compile(r"\s*,?\s*(?<![A-Za-z\\])(?:and|or)(?![A-Za-z])\s*")
_UNIT_WORDS = (
    "square units|sq units|units?|degrees?|cm|mm|km|meters?|metres?|centimeters?|kilometers?"
    "|inches|inch|in|feet|foot|ft|yards?|miles?|mph|seconds?|sec|minutes?|min|hours?|hrs?|days?"
    "|weeks?|months?|years?|dollars?|cents?|grams?|kg|pounds?|lbs?|liters?|ml|ways|people"
)
# Units that are single letters, as variables are: a unit only when written as text.
_LETTER_UNITS = "m|s|g"
_POWER = r"(?:\s*\^\s*\{?\d\}?)?"
# A unit is stripped only when it follows a number or closing brace after a space (as left by
# `10\\text{ cm}`), so a variable such as the `x` in `2x` is never taken for a unit; a unit
# in a text wrapper (`3\\text{m}`, `5\\,\\mathrm{s}^2`) is stripped before wrappers are removed.
# A bare letter is a variable: `3 m` is 3m and `\\frac{\\sqrt{3}}{4} s^2` an area in s.
_TRAILING_UNIT = re.compile(rf"(?<=[\d}}])\s+(?:{_UNIT_WORDS}){_POWER}\.?$")
_WRAPPED_UNIT = re.compile(
    rf"(?<=[\d}}])\s*\\(?:text|textrm|mathrm|mbox)\s*\{{\s*(?:{_UNIT_WORDS}|{_LETTER_UNITS})\s*\}}"
    rf"{_POWER}\.?$"
)
# A number and the noun it counts, written as text: `3 \\text{ apples}`, `7\\mbox{ days}`,
# `\\text{3 apples}`; the noun does not change the value (MATH writes `3 \\text{ marbles}`). A
# noun is words of two or more letters (a single letter is a variable or one of the units
# above). Words that hedge or qualify the number (`3 \\text{ or more}`, `5 \\text{ (or 6)}` has
# no noun at all), change its value (`2 \\text{ dozen}`, `3 \\text{ million}`, `2 \\text{ thirds}`,
# `3 \\text{ squared}`) or name a constant or operation (`3 \\text{ pi}`) make it no noun.
_NOT_NOUNS = (
    "or|and|nor|not|no|non|more|less|fewer|least|most|than|at|about|approximately|approx|around"
    "|roughly|nearly|almost|over|under|above|below|up|to|plus|minus|between|either|maybe|perhaps"
    "|possibly|probably|except|but|else|other|minimum|maximum|max"
    "|dozens?|scores?|gross|hundreds?|thousands?|millions?|billions?|trillions?|halves|halfs?"
    "|thirds?|quarters?|fourths?|fifths?|sixths?|sevenths?|eighths?|ninths?|tenths?|hundredths?"
    "|thousandths?|millionths?|squared|cubed|powers?|factorial|roots?|sqrt|pi|tau|phi|log|ln|exp"
    "|mod|divided|negative|inverse|reciprocal|infinity|infinite"
)
# One parse per word (a letter, then optional hyphen and letter pairs): linear in its length.
_NOUN_WORD = rf"(?!(?i:{_NOT_NOUNS})(?![A-Za-z-]))[A-Za-z](?:-?[A-Za-z])+"
_NOUN = rf"{_NOUN_WORD}(?: {_NOUN_WORD})*"
_TEXT_WRAPPER = r"\\(?:text|textrm|textbf|textit|textnormal|mathrm|mbox)\s*\{"
_WRAPPED_NOUN = re.compile(rf"(?<=[\d}}])\s*{_TEXT_WRAPPER}\s*{_NOUN}\s*\}}\.?$")
_NUMBER_AND_NOUN = re.compile(rf"^{_TEXT_WRAPPER}\s*([+-]?\d+(?:\.\d+)?) {_NOUN}\s*\}}\.?$")
# `\frac12` and `\sqrt2`: TeX takes single-character arguments.
_BARE_FRAC = re.compile(r"\\frac(\d)(\d)")
_BARE_SQRT = re.compile(r"\\sqrt(\d)")


def _unwrap(text: str) -> str:
    """Replace each `\\text{...}`-style wrapper by its content (nested braces respected).

    One pass; a wrapper whose brace never closes is left as written.
    """
    out: list[str] = []
    # Per open brace: None for a plain `{`, else (where its wrapper stood in `out`, the wrapper).
    stack: list[tuple[int, str] | None] = []
    position = 0
    for match in _WRAPPER_TOKEN.finditer(text):
        out.append(text[position : match.start()])
        position = match.end()
        token = match.group(0)
        if token == "{":
            stack.append(None)
            out.append(token)
        elif token == "}":
            opener = stack.pop() if stack else None
            if opener is None:
                out.append(token)
        elif token.endswith("{") and _WRAPPER.fullmatch(token):
            stack.append((len(out), token))
        else:
            out.append(token)
    out.append(text[position:])
    for opener in reversed(stack):
        if opener is not None:
            out.insert(*opener)
    return "".join(out)


# Brackets and how they move the depth; `\\{ \\}` are set braces. Other escapes are inert.
_DEPTH_CHANGE = {"(": 1, "[": 1, "{": 1, "\\{": 1, ")": -1, "]": -1, "}": -1, "\\}": -1}


@functools.cache
def _scanner(separator: str) -> re.Pattern:
    """Tokens that matter for splitting at `separator`: it, commands, escapes and brackets."""
    word_end = r"(?![A-Za-z])" if separator[-1].isalpha() else ""
    return re.compile(re.escape(separator) + word_end + r"|\\[A-Za-z]+|\\.|[()\[\]{}]", re.DOTALL)


def split_top_level(text: str, separator: str) -> list[str]:
    """`text` cut at each `separator` outside all brackets (a command such as `\\pm` as a whole)."""
    parts, start, depth = [], 0, 0
    for match in _scanner(separator).finditer(text):
        token = match.group(0)
        if token == separator:
            if depth == 0:
                parts.append(text[start : match.start()])
                start = match.end()
        else:
            depth += _DEPTH_CHANGE.get(token, 0)
    parts.append(text[start:])
    return parts


def bracket_pairs(text: str) -> dict[int, int]:
    """Where each bracket's partner starts, keyed both ways (a closer closes the innermost open
    bracket whatever its kind, so intervals `[a, b)` pair up); unmatched brackets are absent."""
    pairs, opened = {}, []
    for match in _scanner(",").finditer(text):
        change = _DEPTH_CHANGE.get(match.group(0), 0)
        if change > 0:
            opened.append(match.start())
        elif change < 0 and opened:
            start = opened.pop()
            pairs[start], pairs[match.start()] = match.start(), start
    return pairs


def answer_parts(normal: str) -> tuple[list[str], str]:
    """The elements of a normalised answer and the brackets that order them.

    `\\{a,b\\}` and a bare list `a,b` are unordered: brackets `""`. A bracketed list with a
    top-level comma, `(a,b)` or `[a,b)`, is a tuple or interval: brackets `"()"`, `"[)"`. Anything
    else is one element. The elements are not split further (`\\pm` stays inside its element).
    """
    closer = bracket_pairs(normal).get(0)
    if normal.startswith("\\{") and closer == len(normal) - 2 and normal.endswith("\\}"):
        return split_top_level(normal[2:-2], ","), ""
    if normal[:1] in ("(", "[") and closer == len(normal) - 1 and normal[-1] in ")]":
        elements = split_top_level(normal[1:-1], ",")
        if len(elements) > 1:
            return elements, normal[0] + normal[-1]
    return split_top_level(normal, ","), ""


def _collapse_spacing(text: str) -> str:
    return _SPACING_RUN.sub(lambda m: m.group(1) or " ", text)


def _mixed_number(match: re.Match) -> str:
    whole, numerator, denominator = match[1], match[2] or match[4], match[3] or match[5]
    numerator, denominator = numerator.lstrip("0"), denominator.lstrip("0")
    if not numerator or (len(numerator), numerator) >= (len(denominator), denominator):
        return match[0]  # not a proper fraction: a product such as `2\\frac{5}{4}`
    return f"({whole}+\\frac{{{numerator}}}{{{denominator}}})"


def tidy(answer: str) -> str:
    """`answer` with each run of spacing made one space and each line break `\\\\` outside an
    environment made a comma (`6 \\\\ 5` states two values, as `6, 5` does), and each mixed
    number `2\\frac{1}{4}` made the sum `(2+\\frac{1}{4})`. None changes what the LaTeX means;
    everything that reads an answer reads this form."""
    text = _MIXED_NUMBER.sub(_mixed_number, _collapse_spacing(answer))
    out, position, depth = [], 0, 0
    for match in _LINE_BREAK_TOKEN.finditer(text):
        token = match.group(0)
        if token == "\\begin":
            depth += 1
        elif token == "\\end":
            depth = max(depth - 1, 0)
        elif token == "\\\\" and depth == 0:
            out.append(text[position : match.start()] + ", ")
            position = match.end()
    out.append(text[position:])
    return "".join(out).strip()


def _spaced_normal_form(answer: str) -> str:
    """The normal form before spaces are dropped (which glues `\\sim b` into `\\simb`)."""
    text = tidy(_TEX_THOUSANDS.sub("{,}", answer))
    text = _WRAPPED_UNIT.sub("", text)
    if "\\text" in text or "\\m" in text:  # most answers hold no text wrapper: skip the scans
        text = _NUMBER_AND_NOUN.sub(r"\1", _WRAPPED_NOUN.sub("", text))
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = text.replace("{,}", "")  # `1{,}000`: a thousands separator in TeX
    text = _unwrap(text)
    text = _NOISE.sub(" ", text)
    text = _collapse_spacing(text)  # unwrapping can bring spaces together
    text = _LIST_WORD.sub(", ", text)
    text = _DEGREES.sub("", text)
    text = _PERCENT.sub("", text)
    text = text.strip().rstrip(".").strip()
    text = _TRAILING_UNIT.sub("", text)
    text = _BARE_FRAC.sub(r"\\frac{\1}{\2}", text)
    return _BARE_SQRT.sub(r"\\sqrt{\1}", text)


def normalize_answer(answer: str) -> str:
    """The canonical form of `answer` (a boxed answer's content); may be the empty string."""
    spaced = _spaced_normal_form(answer)
    text = re.sub(r"\s+", "", spaced)
    if _THOUSANDS.match(text) and not _LIST_COMMA.search(spaced):
        text = text.replace(",", "")
    # `x=1,x=2`: solutions of one unknown. Different names (`a=2,b=3`) stay: see `named_parts`.
    named = _names_and_values(text)
    if named is not None and len({name for name, _ in named}) == 1:
        return ",".join(value for _, value in named)
    return _LEADING_NAME.sub("", text)


# Relations an answer may chain its values with; `\\approx` and the like also mark an approximation,
# `x \\in (1, 3)` names a value as `x = ` does.
_RELATIONS = ("=", "\\equiv", "\\in", "\\approx", "\\simeq", "\\sim", "\\thickapprox", "\\approxeq", "\\doteq", "\u2248", "\u2243")
_NAME_ALONE = re.compile(_NAME_ONLY)


def stated_values(answer: str) -> list[str] | None:
    """The values an answer written as a relation chain states, without the name it gives them:
    `x = 6 = 5` -> ["6", "5"], `\\approx 3.14` -> ["3.14"], `\\frac{1}{3} \\approx 0.333` ->
    ["\\frac{1}{3}", "0.333"], `2x + 3 = y` -> ["2x+3"], `3x + 2y = 12` -> ["3x+2y", "12"] (an
    equation); None when it has no relation outside brackets."""
    parts = [_spaced_normal_form(answer)]
    for relation in _RELATIONS:
        parts = [piece.strip() for part in parts for piece in split_top_level(part, relation)]
    if len(parts) == 1:
        return None
    if not parts[0] or _NAME_ALONE.fullmatch(parts[0]):
        return parts[1:]
    if len(parts) == 2 and _NAME_ALONE.fullmatch(parts[1]):
        return parts[:1]
    return parts


def _names_and_values(text: str) -> list[tuple[str, str]] | None:
    """`a=2,b_{1}=3` -> [("a=", "2"), ("b_1=", "3")]: a list of two or more `name=value`."""
    matches = [_NAMED_PART.fullmatch(part) for part in split_top_level(text, ",")]
    if len(matches) < 2 or not all(matches):
        return None
    return [(match.group(1).replace("{", "").replace("}", ""), match.group(2)) for match in matches]


def named_parts(normal: str) -> dict[str, str] | None:
    """The values of a normalised answer that gives values to different names, by name
    (`a=2,b=3` -> {"a=": "2", "b=": "3"}, in written order); None for any other answer."""
    named = _names_and_values(normal)
    if named is None or len({name for name, _ in named}) < len(named):
        return None
    return dict(named)
