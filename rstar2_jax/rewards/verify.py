"""Answer equivalence and the binary outcome reward (docs/verifier.md).

The paper's verifier accepts when either a rule-based normaliser or math-verify says equal.
We keep that union but are stricter where math-verify is known to be wrong. The rule behind
each step: no tolerance ever accepts what is not proven equal.

1. equal normal forms (`normalize.py`) -> equal;
2. an answer that states several values in a relation chain (`x = 6 = 5`, `6 = 5`,
   `\\frac{1}{3} \\approx 0.333`, `\\approx 3.14`) -> equal only if each value is (math-verify
   reads the last one only), unless the reference itself is an equation (`3x + 2y = 12`);
3. a reference giving values to different names (`a=2, b=3`) -> compared name by name, or in
   its order if the answer gives bare values (math-verify would accept `3, 2`); a set names
   nothing;
4. both sides exact closed-form numbers (`exact.py`) -> exact comparison decides, both ways.
   math-verify rounds to 6 decimals, so it calls 1/2004! and 1/2006! equal. A number too large
   to evaluate (more than 200,000 bits) is not read: not equal;
5. an answer with `\\pm` that step 4 could not read -> not equal (math-verify drops the sign
   set in some directions and would accept `2021` for `\\pm 2021`);
6. an answer holding a number too large to evaluate (`x^{5^{5^{5}}}`) -> not equal, before
   math-verify would try to compute it;
7. otherwise math-verify, gold first (`verify` is not symmetric), with the gold wrapped in
   `\\boxed{}` as rStar2 does, on the `tidy` text of both (at most `MAX_ANSWER_CHARS` each).
   Every decimal it reads is taken as the exact rational it spells (it would round it: a
   policy could box `3.1415934\\ldots` for pi), and if both parses are then numbers they are
   compared exactly. Each box is read whole as LaTeX (math-verify would pick the last number
   out of a box it cannot read: `6 \\Rightarrow 5`), its numeric step proves numbers equal
   instead of chopping their difference below 1e-15 (`2x + 1.4142135623730951` for
   `2x + \\sqrt{2}`, in tuples and intervals too), and its symbolic step runs only where
   evaluation cannot tell the sides apart (`differ_numerically`).

Several boxes in one final answer (`answer_matches`) are one answer only where that cannot buy
reward for hedging: they match when every box states the reference, or when the reference has
several parts and the boxes together state exactly those parts.

Nothing here raises on any input: an answer that cannot be read is not equal. Everything runs
in the calling process with math-verify's own timeouts disabled (they are SIGALRM-based and
break off the main thread). The guards above keep known pathological answers from reaching
sympy, but sympy can still grind in C code on inputs no guard foresaw, which nothing
in-process can interrupt: the trainer scores through `VerifierPool`, which kills such calls
from outside.
"""

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Sequence

import math_verify
import math_verify.grader
import sympy

from rstar2_jax.rewards.exact import (
    NotExact,
    TooLarge,
    differ_numerically,
    has_huge_number,
    parse_exact,
    same_value,
)
from rstar2_jax.rewards.extract import extract_boxes
from rstar2_jax.rewards.normalize import (
    answer_parts,
    named_parts,
    normalize_answer,
    split_top_level,
    stated_values,
    tidy,
)

# Longest answer (normal form, and text given to math-verify, in characters) compared by value;
# a longer one is equal only to the same normal form. Real answers are far shorter; this bounds
# the work one answer can ask.
MAX_ANSWER_CHARS = 2000

# Both sides are box contents, each read whole as LaTeX (the box is the first and only match).
# rStar2 also let math-verify read the answer as a plain expression and try every other match
# in the text, which picks the last number or fraction out of any box the LaTeX reader cannot
# read: `6 \Rightarrow 5`, `\frac{1}{2} \cup \frac{3}{4}`, `\begin{cases} 6 \\ 5 \end{cases}`
# and `6 \cr 5` answered their last value.
# Units are the normaliser's business: math-verify's own unit removal deletes variables named
# like units (`3 m` answered 3, `\frac{\sqrt{3}}{4} s^2` answered the coefficient).
_CONFIG = (
    math_verify.LatexExtractionConfig(
        normalization_config=dataclasses.replace(
            math_verify.LatexExtractionConfig().normalization_config, units=False
        )
    ),
)
_PARSE_OPTIONS = dict(extraction_mode="first_match", parsing_timeout=None, raise_on_error=False)

logger = logging.getLogger(__name__)
# math-verify warns on every call that its timeouts are disabled; we time out from outside.
logging.getLogger("math_verify").setLevel(logging.ERROR)


def _is_exact_number(value: object) -> bool:
    return (
        isinstance(value, sympy.Expr)
        and value.is_number
        and not value.has(sympy.Float)
        and value.is_finite is True
    )


def _numbers_proven_equal(a: object, b: object, float_rounding: int, numeric_precision: int) -> bool:
    """math-verify's numeric step (`grader.sympy_numeric_eq`, same signature) without its
    tolerance, put in its place during our own comparisons (`_strict_steps`).

    math-verify took two expressions as equal when their difference evaluated to 0 once values
    below 10^-15 were chopped, wherever they stood: `2x + 1.4142135623730951` for
    `2x + \\sqrt{2}`, `\\sin(x) + 10^{-20}` for `\\sin(x)`, an approximation inside a tuple. Here
    two numbers are equal only when `same_value` proves it, matrices element by element; any
    other pair is left to math-verify's symbolic step (`simplify(a - b)` is zero)."""
    if isinstance(a, sympy.MatrixBase) and isinstance(b, sympy.MatrixBase):
        return a.shape == b.shape and all(
            _numbers_proven_equal(x, y, float_rounding, numeric_precision) for x, y in zip(a, b)
        )
    if isinstance(a, sympy.Expr) and isinstance(b, sympy.Expr) and a.is_number and b.is_number:
        return same_value(a.doit(), b.doit())
    return False


_SYMBOLIC_EQ = math_verify.grader.sympy_symbolic_eq


def _proven_equal(a: object, b: object) -> bool:
    """math-verify's symbolic step (`grader.sympy_symbolic_eq`: `simplify(a - b)` is zero),
    tried only where evaluation cannot tell the two sides apart (`differ_numerically`).

    `simplify` rewrites `r \\ln 2` as `\\ln 2^r`, and for a decimal `r` of 16 digits (a printed
    float: `0.5849625007211562 x` for `x \\log_2 3`) it computes the integer 2^(10^16)
    without end; numerically the two differ at once, and refuting them there settles it."""
    if isinstance(a, sympy.Expr) and isinstance(b, sympy.Expr) and differ_numerically(a, b):
        return False
    return _SYMBOLIC_EQ(a, b)


# math-verify calls its two steps by these module-level names from every comparison (scalars,
# tuples, sets, intervals, relations), and offers no hook for them. They are swapped in only for
# the duration of our own `verify` call, under a lock, so that another user of math-verify in the
# same process (any thread) keeps its own semantics.
_STRICT_STEPS = {"sympy_numeric_eq": _numbers_proven_equal, "sympy_symbolic_eq": _proven_equal}
_STRICT_LOCK = threading.Lock()


@contextlib.contextmanager
def _strict_steps():
    with _STRICT_LOCK:
        saved = {name: getattr(math_verify.grader, name) for name in _STRICT_STEPS}
        for name, step in _STRICT_STEPS.items():
            setattr(math_verify.grader, name, step)
        try:
            yield
        finally:
            for name, step in saved.items():
                setattr(math_verify.grader, name, step)


def _decimals_as_rationals(value: object) -> object:
    """`value` with every float the parser made from a decimal replaced by the exact rational
    that decimal spells (`3.1415934` -> 31415934/10^7): a decimal is a number, not a tolerance."""
    if isinstance(value, sympy.MatrixBase):
        return value.applyfunc(_decimals_as_rationals)
    if not isinstance(value, sympy.Basic):
        return value
    return value.xreplace({f: sympy.Rational(str(f)) for f in value.atoms(sympy.Float)})


def _math_verify_equal(pred: str, gold: str) -> bool:
    pred, gold = tidy(pred), tidy(gold)
    if len(pred) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
        return False
    gold_parsed = math_verify.parse(
        f"\\boxed{{{gold}}}", _CONFIG, **_PARSE_OPTIONS
    )
    pred_parsed = math_verify.parse(
        f"\\boxed{{{pred}}}", _CONFIG, **_PARSE_OPTIONS
    )
    if not gold_parsed or not pred_parsed:
        return False
    gold_parsed = [_decimals_as_rationals(value) for value in gold_parsed]
    pred_parsed = [_decimals_as_rationals(value) for value in pred_parsed]
    if _is_exact_number(gold_parsed[0]) and _is_exact_number(pred_parsed[0]):
        return same_value(gold_parsed[0], pred_parsed[0])
    with _strict_steps():
        return math_verify.verify(gold_parsed, pred_parsed, timeout_seconds=None, raise_on_error=False)


def _is_equation(answer: str) -> bool:
    """Whether `answer` relates several values (`3x + 2y = 12`), beyond naming one (`y = 2x + 3`)."""
    values = stated_values(answer)
    return values is not None and len(values) > 1


def _equivalent(pred: str, gold: str) -> bool:
    pred_normal, gold_normal = normalize_answer(pred), normalize_answer(gold)
    if not pred_normal or not gold_normal:
        return False
    if pred_normal == gold_normal:
        return True
    if len(pred_normal) > MAX_ANSWER_CHARS or len(gold_normal) > MAX_ANSWER_CHARS:
        return False
    if len(split_top_level(pred_normal, ",")) == 1 and not _is_equation(gold):
        values = stated_values(pred)
        if values is not None:
            return bool(values) and all(value and _equivalent(value, gold) for value in values)
    gold_named = named_parts(gold_normal)
    if gold_named is not None:
        return _named_equal(pred_normal, gold_named)
    try:
        return parse_exact(pred_normal).equals(parse_exact(gold_normal))
    except TooLarge:
        return False
    except NotExact:
        pass
    if "\\pm" in pred_normal or "\\pm" in gold_normal:
        return False
    if has_huge_number(pred_normal) or has_huge_number(gold_normal):
        return False
    return _math_verify_equal(pred, gold)


def _named_equal(pred_normal: str, gold_named: dict[str, str]) -> bool:
    """A reference naming its parts (`a=2,b=3`) is answered by the same names with equivalent
    values, or by the values alone in the reference's order (`2,3` or `(2,3)`); a set
    (`\\{2,3\\}`) has no order, so it names nothing."""
    pred_named = named_parts(pred_normal)
    if pred_named is not None:
        return pred_named.keys() == gold_named.keys() and all(
            _equivalent(pred_named[name], value) for name, value in gold_named.items()
        )
    elements, brackets = answer_parts(pred_normal)
    return (
        not pred_normal.startswith("\\{")
        and brackets in ("", "()")
        and len(elements) == len(gold_named)
        and all(_equivalent(p, g) for p, g in zip(elements, gold_named.values()))
    )


def _never_raises(what: str, function, *args) -> bool:
    """`function(*args)`, or False (logged) if it raises: an unreadable answer is not equal."""
    try:
        return bool(function(*args))
    except Exception as error:  # sympy, mpmath and the parsers raise many kinds on odd input
        logger.debug("%s could not read %r: %s: %s", what, args, type(error).__name__, error)
        return False


def is_equivalent(pred: str, gold: str) -> bool:
    """Whether the answer `pred` means the same as the reference answer `gold`.

    Both are answer strings (e.g. the content of a `\\boxed{}`), not whole responses. Never
    raises: an answer that cannot be read is not equal, and one whose normal form is longer
    than `MAX_ANSWER_CHARS` is equal only to the same normal form.
    Runs in-process without a timeout: see the module docstring.
    """
    return _never_raises("is_equivalent", _equivalent, pred, gold)


def _boxes_match(boxes: Sequence[str], gold: str) -> bool:
    if not boxes:
        return False
    if all(_equivalent(box, gold) for box in dict.fromkeys(boxes)):
        return True  # one box, or several boxes that all state the reference
    if len(boxes) == 1:
        return False
    gold_normal = normalize_answer(gold)
    if len(split_top_level(gold_normal, "\\cup")) > 1:
        return _equivalent(" \\cup ".join(boxes), gold)  # intervals boxed one by one
    elements, brackets = answer_parts(gold_normal)
    if len(elements) == 1 and "\\pm" not in elements[0]:
        return False  # a single value: disagreeing boxes are candidates, not parts
    joined = ", ".join(boxes)
    return _equivalent(f"({joined})" if brackets == "()" else joined, gold)


def answer_matches(boxes: Sequence[str], gold: str) -> bool:
    """Whether a final answer given as boxed parts (`extract_boxes`) states the reference.

    Accepted when every box is equivalent to `gold` (one box; or the same answer boxed twice),
    or when `gold` has several parts (a list, a set, a tuple, `\\pm`, a union) and the boxes,
    read in order as the parts of one answer, are equivalent to it: `\\boxed{1}, \\boxed{2}`
    answers `\\{1, 2\\}`, `x=\\boxed{3}, y=\\boxed{4}` answers `(3, 4)` and two boxed intervals
    answer their union. For a one-part reference, boxes that disagree are several candidate
    answers, which never earn the reward.
    Never raises.
    """
    return _never_raises("answer_matches", _boxes_match, boxes, gold)


def score(response_text: str, gold: str) -> float:
    """The binary reward of a response: 1.0 if its final boxed answer states `gold`, else 0.0.

    The final answer is the boxes of the last `<answer>` block (`extract_boxes`); they are
    checked with `answer_matches`. Never raises. In-process, without a timeout: for notebooks
    and tests. Training uses `VerifierPool`, which has the same semantics plus a hard timeout.
    """
    return float(_never_raises("score", lambda: _boxes_match(extract_boxes(response_text), gold)))
