"""The reward's pure functions: answer extraction, normalisation, exact values, equivalence.

The labelled corpus (`tests/data/verifier_corpus.jsonl`) holds the end-to-end cases, each with
the mathematical reason for its label; the property tests derive expectations from Python's
exact `int` / `Fraction` arithmetic, never from the code under test.
"""

import json
import pathlib
import time
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rstar2_jax.rewards import (
    answer_matches,
    extract_answer,
    extract_boxes,
    is_equivalent,
    score,
)
from rstar2_jax.rewards.exact import NotExact, TooLarge, has_huge_number, parse_exact
from rstar2_jax.rewards.normalize import normalize_answer

CORPUS_PATH = pathlib.Path(__file__).parent / "data" / "verifier_corpus.jsonl"
CORPUS = [json.loads(line) for line in CORPUS_PATH.read_text().splitlines()]


def test_corpus_is_large_and_balanced():
    assert len(CORPUS) >= 100
    positives = sum(case["expected"] for case in CORPUS)
    assert 30 <= positives <= len(CORPUS) - 30
    assert all(case["why"] for case in CORPUS)


@pytest.mark.parametrize("case", CORPUS, ids=[f"{i}-{c['why'][:40]}" for i, c in enumerate(CORPUS)])
def test_corpus_case(case):
    assert score(case["response"], case["gold"]) == case["expected"]


# --- extraction -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("\\boxed{\\frac{a}{\\sqrt{b}}}", ("\\frac{a}{\\sqrt{b}}",)),
        ("\\boxed{\\{1, 2\\}}", ("\\{1, 2\\}",)),  # escaped braces do not close the box
        ("$\\boxed 17$", ("17",)),
        ("\\fbox{x+1}", ("x+1",)),
        ("\\boxed{ 3 }", ("3",)),
        ("no box here", ()),
        ("\\boxed{}", ()),
        ("\\boxed{unclosed", ()),
        ("\\boxedfoo{3}", ()),  # a different macro
        ("\\boxed{\\boxed{3}}", ("\\boxed{3}",)),  # a box in a box is the outer box's content
        ("} } \\boxed{4}", ("4",)),  # stray braces before the box
        ("{ { \\boxed{4}", ("4",)),
        # The final <answer> block: all of its boxes.
        ("<answer>\\boxed{a}</answer>\\boxed{b}", ("a",)),
        ("<answer>\\boxed{a}</answer><answer>\\boxed{b}</answer>", ("b",)),
        ("<answer>maybe \\boxed{3}, or rather \\boxed{5}</answer>", ("3", "5")),
        ("<answer>\\boxed{1}, \\boxed{}</answer>", ("1",)),  # an empty box states nothing
        ("<answer>\\boxed{1}, \\boxed{2", ("1",)),  # truncated: the second box never closes
        # No block, or a block without boxes: the last box and those glued to it as a list.
        ("\\boxed{a}<answer>no box</answer>", ("a",)),
        ("\\boxed{1} and \\boxed{2}", ("1", "2")),
        ("so $x_1 = \\boxed{2}$, $x_2 = \\boxed{3}$.", ("2", "3")),
        ("$\\boxed{1}$, $\\boxed{2}$, and $\\boxed{3}$.", ("1", "2", "3")),
        ("\\boxed{1}\\text{ or }\\boxed{2}\\quad\\boxed{3}", ("1", "2", "3")),
        ("First I got \\boxed{3}, but correcting the sign: \\boxed{5}", ("5",)),
        ("\\boxed{3}. Then \\boxed{5}", ("5",)),
    ],
)
def test_extract_boxes(text, expected):
    assert extract_boxes(text) == expected


def test_extract_answer_joins_the_boxes():
    text = "<answer>\\boxed{(2, 2)} and \\boxed{(6, 2)}</answer>"
    assert extract_answer(text) == "(2, 2), (6, 2)"
    assert extract_answer("<answer>\\boxed{7}</answer>") == "7"
    assert extract_answer("<answer>7</answer>") is None


# --- normalisation and exact values -------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, normal",
    [
        ("\\dfrac{1}{2}", "\\frac{1}{2}"),
        ("\\frac12", "\\frac{1}{2}"),
        ("\\left( 1, 2 \\right)", "(1,2)"),
        ("10\\text{ cm}^2", "10"),
        ("2x", "2x"),  # a variable is not a unit
        ("x = 5", "5"),
        ("y = 2x = 4", "y=2x=4"),  # a chain of equations is left alone
        ("1,234,567", "1234567"),
        ("1,23", "1,23"),  # not a thousands pattern: a list
        ("50\\%", "50"),
        ("x=1 \\text{ or } x=2", "1,2"),  # solutions of one unknown
        ("1, 2, and 3", "1,2,3"),
        ("x_1 = 3, x_2 = 5", "x_1=3,x_2=5"),  # different names stay
        ("a = 2, b = 3", "a=2,b=3"),
        ("(x, y) = (3, 4)", "(3,4)"),
        ("north", "north"),  # `or` inside a word is not a list
        ("\\text{a\\text{b}c}d", "abcd"),
        ("\\text{abc", "\\text{abc"),  # an unclosed wrapper is left as written
        ("\\boxed{\\boxed{3}}", "3"),
    ],
)
def test_normalize_answer(raw, normal):
    assert normalize_answer(raw) == normal


@pytest.mark.parametrize(
    "text",
    ["5^{5^{5^{5}}}", "10^{10^{10}}", "100000!", "(10^{10})!", "9" * 70_000,
     "(1+\\sqrt{2})^{199999}", "(\\sqrt{2}-3)^{150000}"],
    ids=lambda text: text[:20],
)
def test_huge_values_are_refused_not_computed(text):
    start = time.perf_counter()
    with pytest.raises(TooLarge):
        parse_exact(text)
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize(
    "text, huge",
    [
        ("x+5^{5^{5^{5}}}", True),
        ("x^{10^{6}}", True),  # an exponent above 200,000
        ("x+(10^{1999})^{199999}", True),  # small exponent, large base
        ("x+(10^{10})!", True),
        ("x+20000!", True),
        ("x+\\binom{10^{12}}{5}", True),
        ("x^{1000}", False),
        ("x+2024!", False),
        ("e^{x^2}", False),
        ("x+\\binom{10}{3}", False),
        ("^{!\\binom{", False),  # malformed: nothing to evaluate
    ],
)
def test_huge_numbers_inside_symbolic_answers_are_found(text, huge):
    assert has_huge_number(text) == huge


@pytest.mark.parametrize(
    "text", ["x+1", "\\sin{1}", "2^10", "1/0", "\\infty-\\infty", "(1,2", "2.5.3", "\\pm1\\pm2"]
)
def test_non_numeric_or_malformed_is_not_exact(text):
    with pytest.raises(NotExact):
        parse_exact(text)


# --- properties against exact arithmetic -------------------------------------------------------

integers = st.integers(min_value=-(10**30), max_value=10**30)


@settings(max_examples=60, deadline=None)
@given(integers, integers)
def test_integers_equal_exactly(a, b):
    assert is_equivalent(str(a), str(b)) == (a == b)
    assert is_equivalent(f"{a:,}", str(b)) == (a == b)
    assert is_equivalent(f"{a:,}", str(a))


numerators, denominators = st.integers(-1000, 1000), st.integers(1, 1000)


@settings(max_examples=60, deadline=None)
@given(numerators, denominators, numerators, denominators, st.integers(1, 50))
def test_fractions_compare_by_value(p, q, r, s, k):
    assert is_equivalent(f"\\frac{{{p}}}{{{q}}}", f"{r}/{s}") == (Fraction(p, q) == Fraction(r, s))
    assert is_equivalent(f"\\frac{{{k * p}}}{{{k * q}}}", f"{p}/{q}")  # unreduced is fine


@settings(max_examples=40, deadline=None)
@given(st.integers(-(10**6), 10**6), st.integers(0, 6))
def test_terminating_decimals_are_exact(numerator, digits):
    value = Fraction(numerator, 10**digits)
    decimal = f"{numerator / 10**digits:.{digits}f}"
    assert is_equivalent(decimal, f"\\frac{{{value.numerator}}}{{{value.denominator}}}")
    # One unit in the last place more is a different number, however small the gap.
    assert not is_equivalent(decimal, f"\\frac{{{numerator + 1}}}{{{10**digits}}}")


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(-50, 50), min_size=1, max_size=5), st.randoms(use_true_random=False))
def test_sets_ignore_order_tuples_do_not(elements, random):
    shuffled = list(elements)
    random.shuffle(shuffled)
    as_set = lambda xs: "\\{" + ", ".join(map(str, xs)) + "\\}"
    as_tuple = lambda xs: "(" + ", ".join(map(str, xs)) + ")"
    assert is_equivalent(as_set(shuffled), as_set(elements))
    if len(elements) > 1:
        assert is_equivalent(as_tuple(shuffled), as_tuple(elements)) == (shuffled == elements)


# --- several boxes: derived from Python sets and sequences --------------------------------------

small = st.integers(-30, 30)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(small, min_size=2, max_size=5, unique=True),
    st.sampled_from(["same", "drop", "add"]),
    st.randoms(use_true_random=False),
)
def test_boxes_of_a_set_answer_match_as_a_set(gold, change, random):
    boxes = list(gold)
    random.shuffle(boxes)
    if change == "drop":
        boxes.pop()
    elif change == "add":
        boxes.append(max(gold) + 1)
    gold_text = random.choice(["\\{{{}\\}}", "{}"]).format(", ".join(map(str, gold)))
    assert answer_matches([str(b) for b in boxes], gold_text) == (set(boxes) == set(gold))


@settings(max_examples=40, deadline=None)
@given(small, st.lists(small, min_size=1, max_size=4), st.randoms(use_true_random=False))
def test_several_boxes_for_one_value_must_all_state_it(gold, others, random):
    """Boxing every candidate (hedging) earns nothing: one wrong box fails the answer."""
    boxes = others + [gold]
    random.shuffle(boxes)
    assert answer_matches([str(b) for b in boxes], str(gold)) == all(b == gold for b in boxes)


@settings(max_examples=40, deadline=None)
@given(st.lists(small, min_size=2, max_size=4), st.randoms(use_true_random=False))
def test_boxes_of_a_tuple_answer_match_in_order(gold, random):
    boxes = list(gold)
    random.shuffle(boxes)
    gold_text = "(" + ", ".join(map(str, gold)) + ")"
    assert answer_matches([str(b) for b in boxes], gold_text) == (boxes == gold)


@settings(max_examples=40, deadline=None)
@given(st.lists(small, min_size=2, max_size=4), st.randoms(use_true_random=False))
def test_named_parts_compare_name_by_name(values, random):
    pairs = list(zip("abcd", values))
    gold = ", ".join(f"{name} = {value}" for name, value in pairs)
    shuffled = list(pairs)
    random.shuffle(shuffled)
    named = ", ".join(f"{name}={value}" for name, value in shuffled)
    assert is_equivalent(named, gold)  # names keep their values in any order
    bare = [value for _, value in shuffled]
    assert is_equivalent(", ".join(map(str, bare)), gold) == (bare == values)


def test_score_is_binary_float():
    assert score("\\boxed{4}", "4") == 1.0 and isinstance(score("\\boxed{4}", "4"), float)
    assert score("\\boxed{5}", "4") == 0.0
