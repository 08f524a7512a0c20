"""The toy task: integer problems a tiny model cannot do in its head but can do with one line of Python.

Each problem copies a few numbers into a fixed program shape (modular products, digit sums of
powers, prime counts, gcd/lcm sums, divisor counts). A model of a few million parameters can
learn to copy digits into the program; it cannot learn the arithmetic. Answers are computed
here exactly (plain integer arithmetic), independently of the sandbox that will run the code.

Every problem also carries a cheap heuristic estimate of its answer: what a model that answers
"in its head" without the tool would plausibly say. The SFT demonstrations use it for the
no-tool answers, which are therefore usually wrong.

One kind, ``mod_inverse`` (not in the default mix, `DEFAULT_KINDS`), makes failing tool calls
part of correct solutions: for half of its problems the natural program fails, for a reason no
one can see in the question (a hidden common factor), and its error message says what to do
instead (docs/testbed.md).

Each problem's program comes in two forms: ``code``, one stateless program with the numbers
inline (the main job), and a notebook form for a stateful tool (the testbed's session
environment, docs/testbed.md): ``compute_cell`` binds the numbers to names (``setup``), imports
what it needs and computes ``ans`` from the names (``expression``), and `PRINT_CELL` shows it in
the next call.
"""
from __future__ import annotations

import dataclasses
import math
import random
from typing import Callable, Sequence


@dataclasses.dataclass(frozen=True)
class ToyProblem:
    """One toy problem.

    Attributes:
      question: the problem text.
      answer: the exact integer answer, as decimal text.
      kind: which template made it (one of ``KINDS``).
      code: a Python program that prints the answer.
      estimate: a heuristic mental guess, as decimal text (usually wrong).
      naive_code: the program a solver writes first when the question cannot tell it that
        ``code`` is needed; it fails, and its error says why. None: ``code`` is the natural first
        program.
      setup: the question's numbers bound to names, one assignment a line (``a = 123``).
      imports: the import line ``expression`` needs, or "".
      expression: the answer as an expression of the names of ``setup``.
      naive_expression: ``naive_code``'s expression, written with the names (None with it).
    """

    question: str
    answer: str
    kind: str
    code: str
    estimate: str
    naive_code: str | None = None
    setup: str = ""
    imports: str = ""
    expression: str = ""
    naive_expression: str | None = None

    @property
    def compute_cell(self) -> str:
        """The notebook form's first cell: ``setup``, ``imports``, ``ans = expression``; it prints
        nothing (`PRINT_CELL` does, in the next call)."""
        return "\n".join(line for line in (self.setup, self.imports, f"ans = {self.expression}") if line)


# The notebook form's last cell: the answer that ``compute_cell`` left in the session's state.
PRINT_CELL = "print(ans)"


def _mod_product(rng: random.Random) -> ToyProblem:
    a, b, m = rng.randint(10_000, 999_999), rng.randint(10_000, 999_999), rng.randint(101, 9_999)
    return ToyProblem(
        question=f"What is {a} * {b} mod {m}?",
        answer=str(a * b % m),
        kind="mod_product",
        code=f"print({a} * {b} % {m})",
        estimate=str(rng.randrange(m)),  # any residue looks as likely as another
        setup=f"a = {a}\nb = {b}\nm = {m}", expression="a * b % m",
    )


def _digit_sum_power(rng: random.Random) -> ToyProblem:
    b, e = rng.randint(3, 99), rng.randint(20, 99)
    n_digits = math.floor(e * math.log10(b)) + 1
    return ToyProblem(
        question=f"What is the digit sum of {b}^{e}?",
        answer=str(sum(map(int, str(b**e)))),
        kind="digit_sum_power",
        code=f"print(sum(map(int, str({b}**{e}))))",
        estimate=str(round(4.5 * n_digits)),  # average digit times the digit count
        setup=f"b = {b}\ne = {e}", expression="sum(map(int, str(b**e)))",
    )


def _count_primes(rng: random.Random) -> ToyProblem:
    lo = rng.randint(100, 20_000)
    hi = lo + rng.randint(50, 2_000)
    return ToyProblem(
        question=f"How many primes are there from {lo} to {hi}?",
        answer=str(sum(_is_prime(n) for n in range(lo, hi + 1))),
        kind="count_primes",
        # The question's numbers in its order, nothing computed in the head: written as
        # primepi(hi) - primepi(lo - 1), the program began with the second number and needed a
        # decrement with borrows, and after RL the model wrote the right `hi` in 12% of its
        # programs and the right `lo - 1` in none (seed 2; docs/toy.md, "The outcome over seeds").
        code=f"from sympy import primerange\nprint(len(list(primerange({lo}, {hi} + 1))))",
        estimate=str(round((hi - lo + 1) / math.log(hi))),  # the prime number theorem
        setup=f"lo = {lo}\nhi = {hi}", imports="from sympy import primepi",
        expression="primepi(hi) - primepi(lo - 1)",
    )


def _gcd_lcm(rng: random.Random) -> ToyProblem:
    g = rng.randint(2, 60)  # a shared factor, so that the gcd is not almost always 1
    a, b = g * rng.randint(10, 999), g * rng.randint(10, 999)
    c, d = rng.randint(10, 999), rng.randint(10, 999)
    return ToyProblem(
        question=f"What is gcd({a}, {b}) + lcm({c}, {d})?",
        answer=str(math.gcd(a, b) + math.lcm(c, d)),
        kind="gcd_lcm",
        code=f"from math import gcd, lcm\nprint(gcd({a}, {b}) + lcm({c}, {d}))",
        estimate=str(1 + c * d),  # as if both pairs were coprime
        setup=f"a = {a}\nb = {b}\nc = {c}\nd = {d}", imports="from math import gcd, lcm",
        expression="gcd(a, b) + lcm(c, d)",
    )


def _divisor_count(rng: random.Random) -> ToyProblem:
    n = rng.randint(1_000, 2_000_000)
    return ToyProblem(
        question=f"How many divisors does {n} have?",
        answer=str(_num_divisors(n)),
        kind="divisor_count",
        code=f"from sympy import divisor_count\nprint(divisor_count({n}))",
        estimate=str(2 ** rng.randint(2, 5)),  # typical counts are small powers of two
        setup=f"n = {n}", imports="from sympy import divisor_count", expression="divisor_count(n)",
    )


# Primes of two digits: a hidden factor of the modulus that a number's last digits do not reveal
# (divisibility by 2, 3 and 5 is visible in the digits; by these it is not).
_HIDDEN_PRIMES = (11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83, 89, 97)


def _mod_inverse(rng: random.Random) -> ToyProblem:
    # m = p * q; half the time a is made a multiple of p, so it has no inverse mod m. Nothing in
    # the question shows which half a problem is in: the natural program, pow(a, -1, m), fails
    # with "ValueError: base is not invertible for the given modulus" and the gcd is the answer.
    p, q = rng.sample(_HIDDEN_PRIMES, 2)
    m = p * q
    if rng.random() < 0.5:
        a = p * rng.randint(10_000 // p + 1, 999_999 // p)
    else:
        a = rng.randint(10_000, 999_999)
    inverse = f"print(pow({a}, -1, {m}))"
    named = dict(setup=f"a = {a}\nm = {m}", expression="pow(a, -1, m)")
    if math.gcd(a, m) == 1:
        answer, code, naive = str(pow(a, -1, m)), inverse, None
    else:
        answer, code, naive = str(math.gcd(a, m)), f"from math import gcd\nprint(gcd({a}, {m}))", inverse
        named.update(imports="from math import gcd", expression="gcd(a, m)", naive_expression="pow(a, -1, m)")
    return ToyProblem(
        question=f"What is the inverse of {a} mod {m}, or their gcd if there is none?",
        answer=answer, kind="mod_inverse", code=code,
        estimate=str(rng.randrange(1, m)),  # any residue looks as likely as another
        naive_code=naive, **named,
    )


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % p for p in range(2, math.isqrt(n) + 1))


def _num_divisors(n: int) -> int:
    count, p = 1, 2
    while p * p <= n:
        exponent = 0
        while n % p == 0:
            n //= p
            exponent += 1
        count *= exponent + 1
        p += 1
    return count * (2 if n > 1 else 1)


_GENERATORS: dict[str, Callable[[random.Random], ToyProblem]] = {
    "mod_product": _mod_product,
    "digit_sum_power": _digit_sum_power,
    "count_primes": _count_primes,
    "gcd_lcm": _gcd_lcm,
    "divisor_count": _divisor_count,
    "mod_inverse": _mod_inverse,
}
KINDS: tuple[str, ...] = tuple(_GENERATORS)
# The main job's mix: the kinds whose natural program is right, less gcd_lcm. Its four numbers
# (about 14 digits) are more than the 2-layer toy model learns to copy: after RL it answered 2% of
# them (seed 0; the other kinds 50-79%), and its miscopied calls (leading zeros, garbled
# programs) were most of the tool errors that rose after RL (docs/toy.md, "The outcome over
# seeds"). The testbed's mixes keep it.
DEFAULT_KINDS: tuple[str, ...] = ("mod_product", "digit_sum_power", "count_primes", "divisor_count")


def check_kinds(kinds: Sequence[str]) -> None:
    """Raises ValueError unless ``kinds`` is a non-empty sequence of names in `KINDS`."""
    unknown = set(kinds) - set(KINDS)
    if unknown or not kinds:
        raise ValueError(f"kinds must be a non-empty subset of {KINDS}; unknown: {sorted(unknown)}")


def make_splits(
    n_train: int, n_test: int, seed: int = 0, kinds: Sequence[str] = DEFAULT_KINDS
) -> tuple[list[ToyProblem], list[ToyProblem]]:
    """Disjoint train and test problems, a deterministic function of the arguments.

    Kinds are drawn uniformly at random (a kind listed twice is drawn twice as often); no
    question appears twice across both splits.
    """
    check_kinds(kinds)
    rng = random.Random(seed)
    problems: dict[str, ToyProblem] = {}
    # The question spaces are huge, so duplicates are rare and this loop ends quickly.
    while len(problems) < n_train + n_test:
        problem = _GENERATORS[rng.choice(kinds)](rng)
        problems.setdefault(problem.question, problem)
    ordered = list(problems.values())
    train, test = ordered[:n_train], ordered[n_train:]
    assert not {p.question for p in train} & {p.question for p in test}
    return train, test
