"""Exact values of closed-form numeric answers, so that no float tolerance decides equality.

`parse_exact` reads a normalised answer (see `normalize.py`) built only from numbers and
constants: integers, decimals (taken as the exact rational they spell), `+ - * / ^ !`,
`\\frac`, `\\sqrt`, `\\binom`, `\\cdot`, `\\times`, `\\div`, `\\pi`, `e`, `\\exp`, `\\infty`, brackets and
`\\pm`; and collections of them: sets `\\{a, b\\}`, bare lists `a, b` (solution lists,
unordered), tuples and intervals `(a, b]` (ordered, brackets significant). Anything else
(variables, functions, unknown commands) is not an exact answer and the caller falls back to
math-verify.

Values are sympy expressions evaluated exactly. Results that would be astronomically large
(a power tower, `(10^{10})!`, a number of more than 60,000 digits) are refused with `TooLarge`
instead of computed: building them is exactly the C-level big-integer work that cannot be
interrupted. `has_huge_number` finds such numbers inside answers that are not numeric, such as
`x + 5^{5^{5^{5}}}`, before anything else tries to evaluate them.
"""

import dataclasses
import decimal
import math
import re

import sympy

from rstar2_jax.rewards.normalize import answer_parts, bracket_pairs, split_top_level

# Largest exact result we build, in bits: 2006! (the known trap) has ~19k bits.
_MAX_BITS = 200_000
_TOKEN = re.compile(
    r"\d+\.\d*|\.\d+|\d+"  # numbers; decimals are exact rationals
    r"|\\[A-Za-z]+"  # commands
    r"|e(?![A-Za-z])"  # Euler's number
    r"|\\[{}]"  # set braces
    r"|[-+*/^!(){}\[\],]"
)
# Decimal digits per bit: a number of `d` digits has about `d / _DIGITS_PER_BIT` bits.
_DIGITS_PER_BIT = math.log10(2)
# Precision of the numerical comparison that tells different values apart (`same_value`).
_DIGITS = 50


class NotExact(ValueError):
    """The answer is not a closed-form numeric value this parser can evaluate safely."""


class TooLarge(NotExact):
    """The answer is numeric but too large to evaluate: no answer is read from it."""


@dataclasses.dataclass(frozen=True)
class ExactAnswer:
    """A parsed answer: `values` in written order; `brackets` is `""` for an unordered answer
    (a scalar, a set or a bare list) or the bracket pair of a tuple/interval, e.g. `"(]"`.

    A scalar is read as the one-element set of itself, so `\\{5\\}` answers `5`, while
    `\\pm 5` (the set {5, -5}) does not.
    """

    values: tuple[sympy.Expr, ...]
    brackets: str

    def equals(self, other: "ExactAnswer") -> bool:
        """Exact mathematical equality: as sets when unordered, elementwise when ordered."""
        if self.brackets != other.brackets:
            return False
        if self.brackets:
            return len(self.values) == len(other.values) and all(
                same_value(a, b) for a, b in zip(self.values, other.values)
            )
        return all(any(same_value(a, b) for b in other.values) for a in self.values) and all(
            any(same_value(a, b) for a in self.values) for b in other.values
        )


def same_value(a: sympy.Expr, b: sympy.Expr) -> bool:
    """True only if `a == b` exactly: rationals compare as rationals, other constants must be
    proven equal by sympy (an undecided comparison counts as different).

    Values that differ numerically are different, which settles almost every comparison at
    once: sympy's proof expands powers (`(1+\\sqrt{2})^{10000}` against 5 took 12 s)."""
    if a == b:
        return True
    if a.is_Rational and b.is_Rational:
        return False
    if not (a.is_finite and b.is_finite) or differ_numerically(a, b):
        return False
    return (a - b).equals(0) is True


def differ_numerically(a: sympy.Expr, b: sympy.Expr) -> bool:
    """Whether evaluation tells `a` and `b` apart: their difference is nonzero beyond rounding
    at `_DIGITS` digits, plus the digits of the longest rational they hold (a decimal of 60
    digits is its own number, not a rounding of another). A free variable first takes a sample
    value (an identity holds at every value, so one difference refutes it); where either side is
    not a real number there, nothing is told apart. A numerical difference only ever makes an
    answer wrong: a proof of equality is sympy's business."""
    symbols = sorted(a.free_symbols | b.free_symbols, key=str)
    point = {
        symbol: sympy.Integer(i + 2) if symbol.is_integer else sympy.Rational(2 * i + 3, 7)
        for i, symbol in enumerate(symbols)
    }
    a, b = a.xreplace(point), b.xreplace(point)
    rationals = a.atoms(sympy.Rational) | b.atoms(sympy.Rational)
    bits = max((max(abs(r.p), r.q).bit_length() for r in rationals), default=0)
    digits = _DIGITS + math.ceil(bits * _DIGITS_PER_BIT)
    difference = (a - b).evalf(digits)
    scale = abs(a.evalf(digits)) + abs(b.evalf(digits)) + 1
    return (
        difference.is_comparable
        and scale.is_comparable
        and abs(difference) > scale * sympy.Float(10) ** (10 - digits)
    )


def _tokenize(text: str) -> list[str]:
    tokens, position = [], 0
    for match in _TOKEN.finditer(text):
        if match.start() != position:
            raise NotExact(f"unexpected {text[position:match.start()]!r}")
        tokens.append(match.group(0))
        position = match.end()
    if position != len(text):
        raise NotExact(f"unexpected {text[position:]!r}")
    return tokens


def _defined(value: sympy.Expr) -> sympy.Expr:
    if value.has(sympy.nan, sympy.zoo):
        raise NotExact("undefined value (division by zero?)")
    return value


def _bits(value: sympy.Rational) -> int:
    return max(abs(value.p).bit_length(), abs(value.q).bit_length())


def _number(token: str) -> sympy.Rational:
    """The exact value of a decimal numeral (any length Python's `int(str)` limit refuses)."""
    if len(token) / _DIGITS_PER_BIT > _MAX_BITS:
        raise TooLarge("number too long to evaluate")
    numerator, denominator = decimal.Decimal(token).as_integer_ratio()
    return sympy.Rational(numerator, denominator)


def _log2_size(value: sympy.Expr) -> float:
    """An upper bound on log2 of the integers in the exact expansion of `value`, per unit of
    an exponent it is raised to: `(1+\\sqrt{2})^n` expands to `a + b\\sqrt{2}` with `a` and `b`
    about `(1+\\sqrt{2})^n`, so a sum counts the sizes of all its terms, whatever their signs."""
    if value.is_Rational:
        return math.log2(max(abs(value.p), value.q, 2))
    if value.is_Add:
        return max(_log2_size(term) for term in value.args) + math.log2(len(value.args))
    if value.is_Mul:
        return sum(_log2_size(factor) for factor in value.args)
    if isinstance(value, sympy.exp):  # sympy keeps e^x apart from other powers
        value = sympy.Pow(sympy.E, value.args[0], evaluate=False)
    if value.is_Pow and value.exp.is_Rational:
        return _log2_size(value.base) * abs(float(value.exp))
    if value.is_Pow:  # |exponent| < 2^size; capped where the bound is astronomical anyway
        return _log2_size(value.base) * 2.0 ** min(_log2_size(value.exp), 1000.0)
    return 2.0  # pi, e: below 4


def _power(base: sympy.Expr, exponent: sympy.Expr) -> sympy.Expr:
    """`base ** exponent`, refusing results beyond `_MAX_BITS` before computing them."""
    if base.is_number and base not in (0, 1, -1):
        # |base^(p/q)| has at most |p| * bits(base) bits; integer arithmetic, so no overflow.
        # An irrational base counts the integers its power expands to (at least a bit each).
        base_bits = _bits(base) if base.is_Rational else max(1, math.ceil(_log2_size(base)))
        if exponent.is_Rational and abs(exponent.p) * base_bits > _MAX_BITS:
            raise TooLarge("power too large to evaluate")
        # An irrational exponent is bounded by its size: `e^{e^{e^{100}}}` would have
        # e^(e^100) bits, and evaluating it even to a few digits never ends.
        if not exponent.is_Rational and base_bits * 2.0 ** min(_log2_size(exponent), 1000.0) > _MAX_BITS:
            raise TooLarge("power too large to evaluate")
    return _defined(sympy.Pow(base, exponent))


class _Parser:
    """Recursive descent over tokens; each method consumes one grammar rule."""

    def __init__(self, tokens: list[str]):
        self.tokens = tokens
        self.i = 0

    def peek(self) -> str | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self, expected: str | None = None) -> str:
        token = self.peek()
        if token is None or (expected is not None and token != expected):
            raise NotExact(f"expected {expected!r}, got {token!r}")
        self.i += 1
        return token

    def done(self) -> bool:
        return self.i == len(self.tokens)

    # sum := product (("+" | "-") product)*
    def sum(self) -> sympy.Expr:
        value = self.product()
        while self.peek() in ("+", "-"):
            sign = 1 if self.take() == "+" else -1
            value = value + sign * self.product()
        return _defined(value)

    # product := unary (("*" | "/" | "\cdot" | "\times" | "\div")? unary)*
    def product(self) -> sympy.Expr:
        value = self.unary()
        while True:
            token = self.peek()
            if token in ("*", "\\cdot", "\\times"):
                self.take()
                value = value * self.unary()
            elif token in ("/", "\\div"):
                self.take()
                value = value / self.unary()
            elif self._starts_atom(token):
                value = value * self.power()  # implicit: `2\sqrt{3}`, `3\pi`, `2(5)`
            else:
                return _defined(value)

    # unary := ("+" | "-") unary | power
    def unary(self) -> sympy.Expr:
        if self.peek() in ("+", "-"):
            sign = 1 if self.take() == "+" else -1
            return sign * self.unary()
        return self.power()

    # power := postfix ("^" exponent)?; TeX reads an unbraced exponent as one character, so
    # `2^10` is ambiguous (2^1 * 0 in TeX, 2^10 as meant) and is left to math-verify.
    def power(self) -> sympy.Expr:
        base = self.postfix()
        if self.peek() != "^":
            return base
        self.take()
        token = self.peek()
        if token == "{":
            exponent = self.group("{", "}")
        elif token is not None and (len(token) == 1 and token.isdigit() or token == "\\pi"):
            exponent = self.atom()
        elif token in ("+", "-", "("):
            exponent = self.unary()
        else:
            raise NotExact(f"ambiguous exponent {token!r}")
        return _power(base, exponent)

    # postfix := atom "!"*
    def postfix(self) -> sympy.Expr:
        value = self.atom()
        while self.peek() == "!":
            self.take()
            if not (value.is_Integer and 0 <= value):
                raise NotExact("factorial of a non-natural number")
            if value * math.log2(max(int(value), 2)) > _MAX_BITS:
                raise TooLarge("factorial too large to evaluate")
            value = sympy.factorial(value)
        return value

    def group(self, open_: str, close: str) -> sympy.Expr:
        self.take(open_)
        value = self.sum()
        self.take(close)
        return value

    @staticmethod
    def _starts_atom(token: str | None) -> bool:
        # Not a number: `2.5.3` tokenizes as 2.5 then .3, which is a typo, not a product.
        return token in _ATOM_COMMANDS or token in ("(", "{")

    # atom := number | "(" sum ")" | "{" sum "}" | \frac{}{} | \sqrt[n]{} | \binom{}{}
    #         | \pi | e | \exp() | \exp{} | \infty
    def atom(self) -> sympy.Expr:
        token = self.peek()
        if token is None:
            raise NotExact("unexpected end")
        if token[0].isdigit() or token[0] == ".":
            self.take()
            return _number(token)
        if token == "(":
            return self.group("(", ")")
        if token == "{":
            return self.group("{", "}")
        if token == "\\frac":
            self.take()
            numerator = self.group("{", "}")
            return _defined(numerator / self.group("{", "}"))
        if token == "\\sqrt":
            self.take()
            degree = sympy.Integer(2)
            if self.peek() == "[":
                degree = self.group("[", "]")
            return _power(self.group("{", "}"), 1 / degree)
        if token == "\\binom":
            self.take()
            n, k = self.group("{", "}"), self.group("{", "}")
            if not (n.is_Integer and k.is_Integer and 0 <= n):
                raise NotExact("binomial of non-integers")
            if n > 100_000:
                raise TooLarge("binomial too large to evaluate")
            return sympy.binomial(n, k)
        if token == "\\pi":
            self.take()
            return sympy.pi
        if token == "e":
            self.take()
            return sympy.E
        if token == "\\exp":
            self.take()
            if self.peek() in ("(", "{"):
                argument = self.group(self.peek(), ")" if self.peek() == "(" else "}")
            else:
                argument = self.unary()  # `\\exp 100`, `\\exp\\exp 2`
            return _power(sympy.E, argument)
        if token == "\\infty":
            self.take()
            return sympy.oo
        raise NotExact(f"not a number: {token!r}")


_ATOM_COMMANDS = ("\\frac", "\\sqrt", "\\binom", "\\pi", "e", "\\exp", "\\infty")


def _element_values(element: str) -> list[sympy.Expr]:
    """The values of one element; `a \\pm b` stands for the two values a + b and a - b."""
    parts = split_top_level(element, "\\pm")
    if len(parts) > 2:
        raise NotExact("more than one \\pm")
    if len(parts) == 2:
        left = _evaluate(parts[0]) if parts[0] else sympy.Integer(0)
        right = _evaluate(parts[1])
        return [left + right, left - right]
    return [_evaluate(element)]


def _evaluate(text: str) -> sympy.Expr:
    tokens = _tokenize(text)
    if not tokens:
        raise NotExact("empty expression")
    parser = _Parser(tokens)
    value = parser.sum()
    if not parser.done():
        raise NotExact(f"trailing {parser.peek()!r}")
    return value


def parse_exact(normalized: str) -> ExactAnswer:
    """The exact value(s) of a normalised answer; raises NotExact if it is not a numeric one
    (TooLarge if it is numeric but too large to evaluate)."""
    elements, brackets = answer_parts(normalized)
    try:
        if brackets:
            if any("\\pm" in element for element in elements):
                raise NotExact("\\pm inside a tuple")
            return ExactAnswer(tuple(_evaluate(element) for element in elements), brackets)
        values = [value for element in elements for value in _element_values(element)]
    except RecursionError:
        raise NotExact("nested too deeply") from None
    return ExactAnswer(tuple(values), brackets)


def has_huge_number(normalized: str) -> bool:
    """Whether a normalised answer contains a number too large to evaluate, wherever it stands:
    the exponent of `x^{5^{5^{5}}}`, the power `(10^{1999})^{199999}`, `(10^{10})!`,
    `\\binom{10^{12}}{5}`, `\\exp(\\exp(\\exp(100)))`, inside an answer that is otherwise not numeric.

    Evaluates every braced exponent, and every power, factorial and binomial whose operands are
    closed-form numbers, with this parser's limits; anything it cannot read is no concern here.
    """
    pairs = bracket_pairs(normalized)
    for i, char in enumerate(normalized):
        exponent = expression = ""
        if char == "^" and (end := pairs.get(i + 1, -1)) > i and normalized[i + 1] == "{":
            exponent = normalized[i + 2 : end]
            base = _operand_before(normalized, i, pairs)
            expression = f"{base}^{{{exponent}}}" if base and exponent else ""
        elif char == "!":
            operand = _operand_before(normalized, i, pairs)
            expression = f"{operand}!" if operand else ""
        elif normalized.startswith("\\exp", i) and (end := pairs.get(i + 4, -1)) > i + 4:
            expression = normalized[i : end + 1]  # `\\exp(...)` or `\\exp{...}`
        elif chain := _EXP_CHAIN.match(normalized, i):
            expression = chain.group(0)  # `\\exp\\exp\\exp100`
        elif normalized.startswith("\\binom{", i) and (top_end := pairs.get(i + 6, -1)) > i:
            bottom_end = pairs.get(top_end + 1, -1)  # the bracket right after `{top}`, if any
            expression = normalized[i : bottom_end + 1] if bottom_end > top_end else ""
        if (expression and _too_large(expression)) or (exponent and _too_large(exponent, True)):
            return True
    return False


# Exponentials applied without brackets, as TeX allows: `\\exp\\exp\\exp100`.
_EXP_CHAIN = re.compile(r"(?:\\exp)+(?:\d+(?:\.\d*)?|e)")


def _too_large(expression: str, as_exponent: bool = False) -> bool:
    """Whether `expression` is numeric but too large to evaluate (or, `as_exponent`, to be
    an exponent: above `_MAX_BITS`); False if it is not a closed-form number at all."""
    try:
        values = parse_exact(expression).values
    except TooLarge:
        return True
    except NotExact:
        return False
    return as_exponent and any(value.is_comparable and abs(value) > _MAX_BITS for value in values)


def _operand_before(text: str, end: int, pairs: dict[int, int]) -> str:
    """The number or bracket group that ends at `text[end - 1]`, brackets included; "" if none."""
    if end > 0 and text[end - 1] in ")}":
        start = pairs.get(end - 1, end)
        return text[start:end] if start < end - 1 else ""
    start = end
    while start > 0 and (text[start - 1].isdigit() or text[start - 1] == "."):
        start -= 1
    return text[start:end]
