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

from rstar2_jax.rewards import extract_answer, is_equivalent, score
from rstar2_jax.rewards.exact import NotExact, parse_exact
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
        ("\\boxed{\\frac{a}{\\sqrt{b}}}", "\\frac{a}{\\sqrt{b}}"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces do not close the box
        ("\\boxed{1} and \\boxed{2}", "2"),
        ("$\\boxed 17$", "17"),
        ("\\fbox{x+1}", "x+1"),
        ("\\boxed{ 3 }", "3"),
        ("no box here", None),
        ("\\boxed{}", None),
        ("\\boxed{unclosed", None),
        ("\\boxedfoo{3}", None),  # a different macro
        ("<answer>\\boxed{a}</answer>\\boxed{b}", "a"),
        ("\\boxed{a}<answer>no box</answer>", "a"),
        ("<answer>\\boxed{a}</answer><answer>\\boxed{b}</answer>", "b"),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


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
    ],
)
def test_normalize_answer(raw, normal):
    assert normalize_answer(raw) == normal


@pytest.mark.parametrize("text", ["5^{5^{5^{5}}}", "10^{10^{10}}", "100000!", "(10^{10})!"])
def test_huge_values_are_refused_not_computed(text):
    start = time.perf_counter()
    with pytest.raises(NotExact):
        parse_exact(text)
    assert time.perf_counter() - start < 1.0


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


def test_score_is_binary_float():
    assert score("\\boxed{4}", "4") == 1.0 and isinstance(score("\\boxed{4}", "4"), float)
    assert score("\\boxed{5}", "4") == 0.0
