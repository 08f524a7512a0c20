"""The reward reads hostile text: `score`, `is_equivalent` and `answer_matches` return 0.0 /
False for whatever they cannot read, and never raise.

Named cases are the ones that raised before (an mpmath OverflowError on a power tower, sympy's
TypeError on integers past Python's 4,300-digit `int(str)` limit); the property tests throw
arbitrary code points, LaTeX fragments in any order (deep nesting, unbalanced braces, huge
numbers), power towers and long texts at them. Expectations come from arithmetic (a power
tower is never 5) or are simply "returns a reward", never from the code under test.

In-process scoring has no timeout (sympy work in C cannot be interrupted in-process; the pool
kills it from outside, `test_rewards_pool.py`), so the generated inputs are adversarial for
reading, and symbolic algebra is kept small: no fragment here asks sympy to expand
`(x+1)^{3000}`. Examples are derandomised so that CI runs are reproducible.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rstar2_jax.rewards import answer_matches, extract_boxes, is_equivalent, score
from rstar2_jax.rewards.normalize import normalize_answer

GOLDS = ["5", "1, 2", "(1, 2)", "\\pm 3", "a = 2, b = 3", "x+5", "[0, 1)", "\\frac{1}{2}"]
FRAGMENTS = [
    "\\boxed{", "\\fbox{", "\\boxed ", "{", "}", "\\{", "\\}", "(", ")", "[", "]", "^", "^{",
    "_", "!", "\\frac{", "\\sqrt{", "\\sqrt[", "\\pm", "\\cup", "\\infty", "\\pi", "\\text{",
    "\\left(", "\\right)", "\\cdot", ",", " and ", " or ", "=", "-", "+", "/", ".", "$", "%",
    "^\\circ", " ", "\\", "<answer>", "</answer>", "0", "1", "5", "9", "x", "y",
    "12345678901234567890", "9" * 5000, "\\binom{", "\\dfrac", "\\!", "\ud800", "\u202e", "\x00",
]
# Any code point, lone surrogates included (a JSON `\ud800` in model output decodes to one).
any_text = st.text(st.characters(exclude_categories=()), max_size=400)
latex_soup = st.lists(st.sampled_from(FRAGMENTS), max_size=60).map("".join)
settings_ = settings(max_examples=150, deadline=None, derandomize=True)


def _assert_reward(value):
    assert isinstance(value, float) and value in (0.0, 1.0)


@pytest.mark.parametrize(
    "answer, gold",
    [
        ("5^{5^{5^{5^{5}}}}", "5"),  # OverflowError in mpmath before
        ("1" * 5000, "2"),  # TypeError: past the 4,300-digit limit of int(str)
        ("1" * 5000, "1" * 4999 + "2"),
        ("x + 5^{5^{5^{5}}}", "x + 5"),
        ("(10^{10})! + x", "5"),
        ("\\binom{10^{12}}{10^{11}} + x", "5"),
        ("{" * 3000 + "5" + "}" * 3000, "6"),  # deeper than Python's recursion limit
        ("\\frac{" * 2000 + "1", "1"),  # unbalanced
        ("\\sqrt{" * 1500 + "4" + "}" * 1500, "3"),
        ("(" * 2500 + "1" + ")" * 2500 + ", 2", "1, 3"),
        ("\ud800", "5"),
        ("5\x00", "5\ud800"),
    ],
    ids=lambda value: f"{value[:24]!r}..{len(value)}",
)
def test_named_cases_score_zero_without_raising(answer, gold):
    assert score(f"<answer>\\boxed{{{answer}}}</answer>", gold) == 0.0
    assert is_equivalent(answer, gold) is False
    assert answer_matches([answer, answer], gold) is False


def _with_separators(digits: str) -> str:
    """`1234567` -> `1,234,567`, on the digit string (Python's int(str) stops at 4,300 digits)."""
    head = len(digits) % 3 or 3
    return ",".join([digits[:head]] + [digits[i : i + 3] for i in range(head, len(digits), 3)])


@settings(max_examples=20, deadline=None, derandomize=True)
@given(
    st.integers(1, 9),
    st.text("0123456789", min_size=1, max_size=40),
    st.integers(4301, 6000),
    st.integers(0, 6000),
    st.sampled_from("0123456789"),
)
def test_integers_past_the_int_str_limit_compare_exactly(lead, pattern, length, position, digit):
    """Written with thousands separators, so that only exact comparison can decide."""
    gold = (str(lead) + pattern * length)[:length]
    position %= len(gold)
    answer = gold[:position] + digit + gold[position + 1 :]
    if position == 0 and digit == "0":
        answer = "1" + answer  # keep a leading digit; still a different number
    assert is_equivalent(_with_separators(answer), gold) == (answer == gold)
    assert score(f"<answer>\\boxed{{{answer}.0}}</answer>", gold) == float(answer == gold)


def _read_without_raising(text: str, gold: str) -> None:
    """Every entry point returns a reward or a bool for `text` as a response, a box, an answer."""
    _assert_reward(score(text, gold))
    _assert_reward(score(f"<answer>\\boxed{{{text}}}</answer>", gold))
    _assert_reward(score(f"<answer>{text}", gold))
    assert is_equivalent(text, gold) in (True, False)
    assert answer_matches(extract_boxes(text) or (text,), gold) in (True, False)
    assert answer_matches([text, gold], gold) in (True, False)


@settings_
@given(any_text, st.sampled_from(GOLDS) | any_text)
def test_any_text_is_read_without_raising(text, gold):
    _read_without_raising(text, gold)


@settings_
@given(latex_soup, st.sampled_from(GOLDS) | latex_soup)
def test_latex_fragments_in_any_order_are_read_without_raising(text, gold):
    _read_without_raising(text, gold)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    st.lists(st.integers(2, 99), min_size=2, max_size=6),
    st.sampled_from(["{}", "x+{}", "({})!", "\\frac{{1}}{{{}}}", "{}, 1", "\\sqrt{{{}}}"]),
)
def test_power_towers_are_never_five(bases, context):
    """a^(b^...) with a, b >= 2 is a perfect power, and 5 is not one (nor is x+5 for x = 0)."""
    tower = "".join(f"{base}^{{" for base in bases[:-1]) + str(bases[-1]) + "}" * (len(bases) - 1)
    answer = context.format(tower)
    assert score(f"<answer>\\boxed{{{answer}}}</answer>", "5") == 0.0


@pytest.mark.parametrize(
    "response, reward",
    [
        ("<answer>" + "\\boxed{" * 8000, 0.0),  # quadratic extraction took ~27 s before
        ("<answer>" + "\\boxed{1} " * 50_000 + "</answer>", 0.0),  # 1 is not 5
        ("<answer>" + "\\boxed{5} " * 50_000 + "</answer>", 1.0),  # the same answer, many times
        ("<reason>" + "x" * 1_000_000 + "</reason><answer>\\boxed{5}</answer>", 1.0),
        ("\\boxed{" * 50_000 + "}" * 50_000, 0.0),  # boxes in boxes around nothing
        ("}" * 100_000 + "\\boxed{5}", 1.0),
    ],
    ids=["unclosed-boxes", "wrong-boxes", "repeated-boxes", "long-reasoning", "nested-boxes",
         "stray-braces"],
)
def test_long_responses_are_read(response, reward):
    assert score(response, "5") == reward


# Spacing a policy may put anywhere, in any amount: whitespace and TeX's spacing commands.
SPACINGS = [" ", "\t", "\n", "\\,", "\\;", "\\:", "\\!", "\\ ", "~", "\\quad", "\\qquad", "\\enspace"]
MIXED = "".join(SPACINGS)
# An answer with gaps `{s}`, the reference, and whether the answer states it (by arithmetic:
# spacing never changes a value).
GAPPED = [
    ("1{s}and{s}2", "1, 2", True),  # the list-word pattern: 2,000 spaces took > 30 s (cubic)
    ("1{s}or{s}3", "1, 2", False),
    ("1{s},{s}2", "\\{1, 2\\}", True),
    ("x{s}={s}5", "5", True),
    ("x{s}={s}6{s}={s}5", "5", False),
    ("10{s}cm", "10", True),
    ("90^{s}{{s}\\circ{s}}", "90", True),
    ("25{s}\\%", "25", True),
    ("\\frac{s}{1}{s}{2}{s}", "0.5", True),
    ("\\text{s}{{s}7{s}}", "7", True),
    ("1{s}000", "1000", True),
]
HUGE_GAP_CHARS = 300_000


def _gap(spacing: str) -> str:
    # Ends with a space: `\\quadand` would be one (unknown) command, as TeX reads it.
    return spacing * (HUGE_GAP_CHARS // len(spacing)) + " "


# A superlinear pattern would need hours on a gap of 3 x 10^5 characters; linear reading takes well
# under a second. The time limit only stops a regression (the thread method: a regular expression
# running in C never sees pytest-timeout's signal); no load gets near it.
@pytest.mark.timeout(300, method="thread")
@pytest.mark.parametrize("spacing", SPACINGS + [MIXED], ids=repr)
def test_any_amount_of_any_spacing_is_read_in_linear_time(spacing):
    """`1` + 2,000 spaces + `2` (no list word to end the run) took > 30 s; `\\,` too."""
    for template, gold in (("1{s}000", "1000"), ("1{s}and{s}2", "1, 2")):
        answer = template.replace("{s}", _gap(spacing))
        assert normalize_answer(answer) == normalize_answer(template.replace("{s}", " "))
        assert is_equivalent(answer, gold) is True
        assert score(f"<answer>\\boxed{{{answer}}}</answer>", gold) == 1.0


@pytest.mark.timeout(300, method="thread")
@pytest.mark.parametrize("template, gold, states", GAPPED, ids=lambda value: repr(value)[:24])
def test_any_amount_of_spacing_anywhere_is_read_in_linear_time(template, gold, states):
    answer = template.replace("{s}", _gap(MIXED))
    assert normalize_answer(answer) == normalize_answer(template.replace("{s}", " "))
    assert score(f"<answer>\\boxed{{{answer}}}</answer>", gold) == float(states)
