"""Reward hacks found by probing the verifier as a hostile policy would (issue 36), each as a
family of variants: other constants, coefficients, operators, environments, separators, units.

Every expectation comes from mathematics: a decimal is the rational number it spells, so it is
never an irrational or non-terminating value, and a number plus 10^-20 is a different number;
the digits of the constants are computed here with mpmath at 60 digits, as a policy with a
Python tool would print them. The controls next to each family are answers that are equal and
must stay accepted.
"""

from fractions import Fraction

import mpmath
import pytest

from rstar2_jax.rewards import is_equivalent, score

mpmath.mp.dps = 60

# (LaTeX, value) of constants the exact-number parser cannot read or that do not terminate.
CONSTANTS = [
    ("\\sqrt{2}", mpmath.sqrt(2)),
    ("\\sqrt{3}", mpmath.sqrt(3)),
    ("\\sqrt[3]{5}", mpmath.cbrt(5)),
    ("\\pi", mpmath.pi),
    ("e", mpmath.e),
    ("\\ln 2", mpmath.log(2)),
    ("\\ln 3", mpmath.log(3)),
    ("\\log_{2} 3", mpmath.log(3, 2)),
    ("\\frac{1}{3}", mpmath.mpf(1) / 3),
    ("\\frac{2}{7}", mpmath.mpf(2) / 7),
]
# How a policy prints a constant: Python's float repr (17 digits) or 40 digits.
PRINTED = [lambda value: repr(float(value)), lambda value: mpmath.nstr(value, 40)]
# Answers with a free variable, where the constant is a coefficient or a term.
SYMBOLIC = ["2x + {}", "{} y", "n^2 - {}", "\\sin(t) + {}", "{} a + {} b"]


def _cases(templates):
    return [
        pytest.param(template, latex, value, printed, id=f"{template}|{latex}|{i}")
        for template in templates
        for latex, value in CONSTANTS
        for i, printed in enumerate(PRINTED)
    ]


@pytest.mark.parametrize("template, latex, value, printed", _cases(SYMBOLIC))
def test_decimals_are_not_irrational_coefficients_of_symbolic_answers(template, latex, value, printed):
    """`2x + 1.4142135623730951` for `2x + \\sqrt{2}` passed: math-verify's numeric step chopped
    the difference (below 10^-15) to zero."""
    gold = template.format(*[latex] * template.count("{}"))
    answer = template.format(*[printed(value)] * template.count("{}"))
    assert is_equivalent(answer, gold) is False
    assert score(f"<answer>\\boxed{{{answer}}}</answer>", gold) == 0.0
    assert is_equivalent(gold, gold.replace(" ", "")) is True  # the exact form stays accepted


@pytest.mark.parametrize("gold", ["\\sin(x)", "x^{2}", "e^{x}", "\\ln(y)", "\\frac{1}{n}", "2x + \\sqrt{2}"])
@pytest.mark.parametrize("tiny", ["10^{-20}", "10^{-16}", "\\frac{1}{10^{30}}", "0.000000000000000001"])
def test_a_symbolic_answer_plus_a_tiny_number_is_another_answer(gold, tiny):
    assert is_equivalent(f"{gold} + {tiny}", gold) is False
    assert is_equivalent(f"{gold} - {tiny}", gold) is False


@pytest.mark.parametrize(
    "answer, gold",
    [
        ("0.5x + 0.25", "\\frac{x}{2} + \\frac{1}{4}"),  # decimals that are these rationals
        ("1.5 y", "\\frac{3y}{2}"),
        ("x + \\frac{\\ln 4}{2}", "x + \\ln 2"),
        ("\\sqrt{2} + 2x", "2x + \\sqrt{2}"),
        ("\\frac{x}{3}", "\\frac{1}{3} x"),
        ("(x+1)^2", "x^2 + 2x + 1"),
        ("\\sin(x) + 10^{-20} - \\frac{1}{10^{20}}", "\\sin(x)"),
    ],
)
def test_equal_symbolic_answers_stay_equal(answer, gold):
    assert is_equivalent(answer, gold) is True


# Containers whose constant the exact parser cannot read, so math-verify compares them.
CONTAINERS = ["({}, 1)", "(1, {})", "[{}, 5)", "\\{{{}, 7\\}}", "({}, {})"]
UNREADABLE = [(latex, value) for latex, value in CONSTANTS if latex[:3] in ("\\ln", "\\lo", "e")]


@pytest.mark.parametrize("container", CONTAINERS)
@pytest.mark.parametrize("latex, value", UNREADABLE, ids=[latex for latex, _ in UNREADABLE])
@pytest.mark.parametrize("how", ["float", "digits", "root of the square"])
def test_approximations_inside_tuples_and_intervals_are_refused(container, latex, value, how):
    """`(\\sqrt{0.480453013918201424667...}, 1)` passed for `(\\ln 2, 1)`."""
    printed = {
        "float": repr(float(value)),
        "digits": mpmath.nstr(value, 40),
        "root of the square": f"\\sqrt{{{mpmath.nstr(value**2, 50)}}}",
    }[how]
    gold = container.format(*[latex] * container.count("{}"))
    answer = container.format(*[printed] * container.count("{}"))
    assert is_equivalent(answer, gold) is False
    assert is_equivalent(gold, gold) is True


def test_equal_constants_inside_containers_stay_equal():
    assert is_equivalent("(\\frac{\\ln 4}{2}, 1)", "(\\ln 2, 1)") is True
    assert is_equivalent("[\\log_{2} 3, 5)", "[\\log_{2} 3, 5)") is True
    assert is_equivalent("(0.5, \\ln 2)", "(\\frac{1}{2}, \\ln 2)") is True


# Relations and arrows between two values: the answer states 6 and 5 (or relates them); it does
# not state 5 alone. math-verify read the last number out of what its LaTeX reader could not read.
OPERATORS = (
    "\\Rightarrow \\implies \\to \\rightarrow \\longrightarrow \\Longrightarrow \\mapsto \\iff "
    "\\Leftrightarrow \\Longleftrightarrow \\leftrightarrow \\leftarrow \\Leftarrow \\impliedby "
    "\\gets \\equiv \\cong \\sim \\propto \\in \\ni \\notin \\subset \\subseteq \\supset \\supseteq "
    "\\le \\leq \\ge \\geq < > \\lt \\gt \\ne \\neq \\leqslant \\geqslant \\ll \\gg \\mid \\nmid "
    "\\parallel \\perp \\vdash \\models \\therefore \\because : ; \\colon \\approx \\simeq \\doteq "
    "\\asymp \\prec \\succ \\cap \\cup \\setminus \\circ \\leadsto \\sqsubset \\quad \\qquad \\& "
    "\\newline \\cr \\\\"
).split()


@pytest.mark.parametrize("operator", OPERATORS)
@pytest.mark.parametrize("first, last", [("6", "5"), ("\\frac{1}{2}", "\\frac{3}{4}"), ("2x", "x^{2}")])
def test_a_relation_between_two_values_is_not_the_last_value(operator, first, last):
    answer = f"{first} {operator} {last}"
    assert is_equivalent(answer, last) is False
    assert score(f"<answer>\\boxed{{{answer}}}</answer>", last) == 0.0


ENVIRONMENTS = [
    "\\begin{{cases}} {} \\\\ {} \\end{{cases}}",
    "\\begin{{cases}} {} & \\text{{if }} x > 0 \\\\ {} & \\text{{otherwise}} \\end{{cases}}",
    "\\begin{{aligned}} {} \\\\ {} \\end{{aligned}}",
    "\\begin{{gathered}} {} \\\\ {} \\end{{gathered}}",
    "\\begin{{array}}{{c}} {} \\\\ {} \\end{{array}}",
    "\\begin{{matrix}} {} \\\\ {} \\end{{matrix}}",
    "\\begin{{split}} {} \\\\ {} \\end{{split}}",
    "\\substack{{{} \\\\ {}}}",
    "{} \\cr {}",
    "{} \\newline {}",
    "\\begin{{cases}} {} \\cr {} \\end{{cases}}",
]


@pytest.mark.parametrize("environment", ENVIRONMENTS)
@pytest.mark.parametrize("first, last", [("6", "5"), ("\\frac{1}{2}", "\\frac{3}{4}"), ("2x", "x^{2}")])
def test_lines_of_an_environment_are_not_the_last_line(environment, first, last):
    answer = environment.format(first, last)
    assert is_equivalent(answer, last) is False
    assert score(f"<answer>\\boxed{{{answer}}}</answer>", last) == 0.0


@pytest.mark.parametrize(
    "answer, gold",
    [
        ("x = 5", "5"),
        ("x \\in (1, 3)", "(1, 3)"),  # `\in` names the value as `=` does
        ("x \\in \\{1, 2\\}", "1, 2"),
        ("x < 3", "x < 3"),
        ("3 > x", "x < 3"),
        ("6 \\times 5", "30"),
        ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}"),
        ("x \\equiv 5", "5"),
    ],
)
def test_relations_that_name_a_value_stay_accepted(answer, gold):
    assert is_equivalent(answer, gold) is True


# --- lists whose parts have three digits (item 3) -------------------------------------------------

LISTS = [["1", "100"], ["2", "500", "999"], ["-1", "100"], ["12", "345"], ["7", "250.5"], ["1", "000"]]


@pytest.mark.parametrize("parts", LISTS, ids=", ".join)
@pytest.mark.parametrize("separator", [", ", " ,", " , ", ",\\ ", ",\\quad ", "\\text{ and }", " or "])
def test_a_list_with_three_digit_parts_is_a_list(parts, separator):
    """For the reference `1, 100` the right answers scored 0 and `1100` scored 1: the thousands
    separator was tested after whitespace was removed."""
    gold = separator.join(parts)
    glued = "".join(parts)
    assert score(f"<answer>\\boxed{{{glued}}}</answer>", gold) == 0.0
    assert score(f"<answer>\\boxed{{{', '.join(parts)}}}</answer>", gold) == 1.0
    boxes = ", ".join(f"\\boxed{{{part}}}" for part in parts)
    assert score(f"<answer>{boxes}</answer>", gold) == 1.0
    if len(set(parts)) == len(parts):
        assert is_equivalent("\\{" + ", ".join(reversed(parts)) + "\\}", gold) is True


@pytest.mark.parametrize(
    "written, value",
    [("1,100", "1100"), ("10,\\!000", "10000"), ("1,\\!000,\\!000", "1000000"), ("1{,}100", "1100"),
     ("12\\,345", "12345"), ("1,234,567.5", "1234567.5")],
)
def test_thousands_separators_without_spacing_stay_numbers(written, value):
    assert is_equivalent(written, value) is True
    assert is_equivalent(value, written) is True


# --- mixed numbers (item 4) -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "mixed, whole, numerator, denominator",
    [("2\\frac{1}{4}", 2, 1, 4), ("2\\dfrac{1}{4}", 2, 1, 4), ("2 \\frac{1}{4}", 2, 1, 4),
     ("3\\tfrac{2}{3}", 3, 2, 3), ("1\\frac12", 1, 1, 2), ("12\\frac{5}{7}", 12, 5, 7),
     ("-2\\frac{1}{4}", -2, 1, 4), ("1\\frac{99}{100}", 1, 99, 100)],
)
def test_mixed_numbers_are_sums(mixed, whole, numerator, denominator):
    """MATH writes 2 1/4 as `2\\frac{1}{4}`: it is 9/4 (a negative one is -(2 + 1/4)), never the
    product 2 * 1/4."""
    sign = -1 if whole < 0 else 1
    total = Fraction(sign) * (abs(whole) + Fraction(numerator, denominator))
    product = Fraction(whole) * Fraction(numerator, denominator)
    as_fraction = lambda value: f"\\frac{{{value.numerator}}}{{{value.denominator}}}"
    assert score(f"<answer>\\boxed{{{as_fraction(total)}}}</answer>", mixed) == 1.0
    assert score(f"<answer>\\boxed{{{as_fraction(product)}}}</answer>", mixed) == 0.0
    assert is_equivalent(mixed, as_fraction(total)) is True


@pytest.mark.parametrize(
    "product, value",
    [("2\\frac{5}{4}", "\\frac{5}{2}"), ("x^2\\frac{1}{4}", "\\frac{x^2}{4}"), ("2\\cdot\\frac{1}{4}", "\\frac{1}{2}"),
     ("\\sqrt{2}\\frac{1}{2}", "\\frac{\\sqrt{2}}{2}"), ("0.5\\frac{1}{2}", "\\frac{1}{4}")],
)
def test_products_with_fractions_stay_products(product, value):
    """An improper fraction, an exponent, an explicit product or a decimal before a fraction
    is a product."""
    assert is_equivalent(product, value) is True


# --- unit words that are variables (item 6) -------------------------------------------------------


@pytest.mark.parametrize("letter", ["m", "s", "g"])
@pytest.mark.parametrize("value", ["3", "\\frac{\\sqrt{3}}{4}", "2\\pi", "12"])
@pytest.mark.parametrize("power", ["", "^2", "^{3}"])
def test_a_letter_after_a_number_is_a_variable(letter, value, power):
    """`\\frac{\\sqrt{3}}{4}` scored 1 for `\\frac{\\sqrt{3}}{4} s^2` and `3` for `3 m`."""
    gold = f"{value} {letter}{power}"
    assert is_equivalent(value, gold) is False
    assert score(f"<answer>\\boxed{{{value}}}</answer>", gold) == 0.0
    assert is_equivalent(f"{value}{letter}{power}", gold) is True


@pytest.mark.parametrize(
    "answer, gold",
    [("3", "3\\text{ m}"), ("3", "3\\text{m}"), ("5", "5\\,\\mathrm{s}^2"), ("2", "2\\mbox{ g}"),
     ("10", "10 cm"), ("10", "10\\text{ cm}^2"), ("12", "12 square units"), ("7", "7 \\text{meters}"),
     ("4", "4\\text{ mph}")],
)
def test_units_written_as_units_are_stripped(answer, gold):
    assert is_equivalent(answer, gold) is True
    assert is_equivalent(gold, answer) is True


# --- a number and the noun it counts, written as text (issue 51, item 5) --------------------------

NOUNS = ["apples", "marbles", "days", "ways", "red apples", "students", "well-known facts"]


@pytest.mark.parametrize("noun", NOUNS)
@pytest.mark.parametrize("wrapper", ["\\text", "\\mbox", "\\textbf", "\\textrm"])
@pytest.mark.parametrize("layout", ["{n} {w}{{ {noun}}}", "{n}{w}{{{noun}}}", "{w}{{{n} {noun}}}",
                                    "\\frac{{{n}}}{{2}} {w}{{ {noun}}}"])
def test_a_number_and_the_noun_it_counts_score_as_the_number(noun, wrapper, layout):
    """Round four's unit list scored `\\boxed{3 \\text{ apples}}` 0 against `3`; MATH answers
    carry such nouns (`3 \\text{ marbles}`, `7 \\text{ days}`, `4 \\text{ ways}`)."""
    answer = layout.format(n=7, w=wrapper, noun=noun)
    gold = "7" if "frac" not in layout else "\\frac{7}{2}"
    assert score(f"<answer>\\boxed{{{answer}}}</answer>", gold) == 1.0
    assert score(f"<answer>\\boxed{{{answer}}}</answer>", "8") == 0.0
    assert is_equivalent(gold, answer) is True


@pytest.mark.parametrize("answer", [
    "5 \\text{ (or 6)}", "5 \\text{ or more}", "5 \\text{ or fewer}", "5 \\mbox{ Or More}",
    "5 \\text{ at least}", "\\text{5 or 6}", "\\text{5 apples or 6}", "5 \\text{ apples or 6}",
    "5 \\text{ dozen}", "\\text{5 million}", "5 \\text{ thousand}", "5 \\text{ thirds}",
    "5 \\text{ squared}", "5 \\text{ factorial}", "5 \\text{ pi}", "5 \\text{ x}",
    "5 \\text{ apples}^2"])
def test_hedges_and_words_that_change_the_number_are_not_nouns(answer):
    """A word that hedges (`or more`), scales (`dozen`, `million`, `thirds`), operates
    (`squared`) or is a constant or variable (`pi`, `x`) is part of the answer."""
    assert score(f"<answer>\\boxed{{{answer}}}</answer>", "5") == 0.0


# --- sets for named parts (item 7) ----------------------------------------------------------------


@pytest.mark.parametrize(
    "answer, gold",
    [("\\{2, 3\\}", "a = 2, b = 3"), ("\\{3, 2\\}", "a = 2, b = 3"), ("\\left\\{2, 3\\right\\}", "a = 2, b = 3"),
     ("\\{1, 5, 7\\}", "x = 1, y = 5, z = 7"), ("\\{\\frac{1}{2}, 4\\}", "p = \\frac{1}{2}, q = 4")],
)
def test_a_set_does_not_answer_named_parts(answer, gold):
    """A set has no order, so it cannot give each name its value."""
    assert is_equivalent(answer, gold) is False


def test_named_parts_are_still_answered_in_order_or_by_name():
    assert is_equivalent("2, 3", "a = 2, b = 3") is True
    assert is_equivalent("(2, 3)", "a = 2, b = 3") is True
    assert is_equivalent("b = 3, a = 2", "a = 2, b = 3") is True
    assert is_equivalent("3, 2", "a = 2, b = 3") is False


# --- numbers that cannot be evaluated (item 9) ----------------------------------------------------

TOWERS = ["\\exp(\\exp(\\exp(100)))", "e^{e^{e^{100}}}", "\\mathrm{e}^{\\mathrm{e}^{\\mathrm{e}^{100}}}",
          "\\exp(-\\exp(\\exp(50)))", "\\exp\\left(\\exp\\left(\\exp(100)\\right)\\right)", "\\exp \\exp \\exp 100",
          "e^{-e^{e^{10}}}", "2^{e^{e^{100}}}"]


@pytest.mark.parametrize("tower", TOWERS)
@pytest.mark.parametrize("context", ["{}", "{} + x", "x {}", "({}, 1)"])
@pytest.mark.timeout(300, method="thread")
def test_exponential_towers_are_refused_before_evaluation(tower, context):
    """Evaluating e^(e^(e^100)) even to a few digits never ends (each such answer cost the pool
    a timeout and a worker): it is refused as too large, as power towers are."""
    from rstar2_jax.rewards.exact import has_huge_number
    from rstar2_jax.rewards.normalize import normalize_answer

    answer = context.format(tower)
    assert has_huge_number(normalize_answer(answer)) is True
    assert score(f"<answer>\\boxed{{{answer}}}</answer>", "5") == 0.0
    assert is_equivalent(answer, context.format("x")) is False


ROOT_DEGREE = "9" * 1000


@pytest.mark.parametrize(
    "answer, gold",
    [(f"\\sqrt[{ROOT_DEGREE}]{{3}}", f"\\sqrt[{ROOT_DEGREE}]{{2}}"), (f"\\sqrt[{ROOT_DEGREE}]{{2}}", "1"),
     (f"2^{{\\frac{{1}}{{{ROOT_DEGREE}}}}}", "1"), (f"\\sqrt[{ROOT_DEGREE}]{{2}} x", "x")],
)
@pytest.mark.timeout(300, method="thread")
def test_roots_of_huge_degree_are_told_apart(answer, gold):
    """2^(1/(10^1000 - 1)) is 1 + 7e-1001: not 1, and not the same root of 3. At 50 digits the two
    agreed and sympy's proof never ended; the evaluation now carries the digits of the degree."""
    assert is_equivalent(answer, gold) is False


@pytest.mark.parametrize(
    "answer, gold",
    [("\\exp(2)", "e^{2}"), ("\\exp 2", "e^2"), ("2e", "e + e"), (f"\\sqrt[{ROOT_DEGREE}]{{4}}",
                                                                   f"\\sqrt[{ROOT_DEGREE}]{{2}}^{{2}}")],
)
def test_exponentials_and_roots_that_are_equal_stay_equal(answer, gold):
    assert is_equivalent(answer, gold) is True


# --- input that is not text (item 10) ---------------------------------------------------------------


@pytest.mark.parametrize("response, gold", [(None, "5"), ("\\boxed{5}", None), (5, "5"), (b"\\boxed{5}", "5")])
def test_score_of_anything_but_text_is_zero(response, gold):
    """`score(None, "5")` raised, though `score` is documented never to."""
    assert score(response, gold) == 0.0


def test_math_verify_keeps_its_own_semantics_outside_the_verifier():
    # The strict comparison steps are ours, not every caller's: a user of math-verify in the
    # same process keeps its numeric tolerance, before and after a verification of ours.
    import math_verify

    gold, pred = math_verify.parse("$2x + \\sqrt{2}$"), math_verify.parse("$2x + 1.4142135623730951$")
    assert math_verify.verify(gold, pred)
    assert not is_equivalent("2x + 1.4142135623730951", "2x + \\sqrt{2}")
    assert math_verify.verify(gold, pred)
