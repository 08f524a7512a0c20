"""Exact values of closed-form numeric answers, so that no float tolerance decides equality.

`parse_exact` reads a normalised answer (see `normalize.py`) built only from numbers and
constants: integers, decimals (taken as the exact rational they spell), `+ - * / ^ !`,
`\\frac`, `\\sqrt`, `\\binom`, `\\cdot`, `\\times`, `\\div`, `\\pi`, `\\infty`, brackets and
`\\pm`; and collections of them: sets `\\{a, b\\}`, bare lists `a, b` (solution lists,
unordered), tuples and intervals `(a, b]` (ordered, brackets significant). Anything else
(variables, functions, unknown commands) is not an exact answer and the caller falls back to
math-verify.

Values are sympy expressions evaluated exactly. Results that would be astronomically large
(a power tower, `(10^{10})!`) are refused instead of computed: building them is exactly the
C-level big-integer work that cannot be interrupted.
"""

import dataclasses
import math
import re

import sympy

# Largest exact result we build, in bits: 2006! (the known trap) has ~19k bits.
_MAX_BITS = 200_000
_TOKEN = re.compile(
    r"\d+\.\d*|\.\d+|\d+"  # numbers; decimals are exact rationals
    r"|\\[A-Za-z]+"  # commands
    r"|\\[{}]"  # set braces
    r"|[-+*/^!(){}\[\],]"
)
_UNORDERED_OPEN, _UNORDERED_CLOSE = "\\{", "\\}"


class NotExact(ValueError):
    """The answer is not a closed-form numeric value this parser can evaluate safely."""


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
    proven equal by sympy (an undecided comparison counts as different)."""
    if a == b:
        return True
    if a.is_Rational and b.is_Rational:
        return False
    if not (a.is_finite and b.is_finite):
        return False
    return (a - b).equals(0) is True


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


def _power(base: sympy.Expr, exponent: sympy.Expr) -> sympy.Expr:
    """`base ** exponent`, refusing results beyond `_MAX_BITS` before computing them."""
    if exponent.is_Rational and base.is_number and base not in (0, 1, -1):
        # |base^(p/q)| has at most |p| * bits(base) bits; integer arithmetic, so no overflow.
        base_bits = _bits(base) if base.is_Rational else 1
        if abs(exponent.p) * base_bits > _MAX_BITS:
            raise NotExact("power too large to evaluate")
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
                raise NotExact("factorial too large to evaluate")
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
    #         | \pi | \infty
    def atom(self) -> sympy.Expr:
        token = self.peek()
        if token is None:
            raise NotExact("unexpected end")
        if token[0].isdigit() or token[0] == ".":
            self.take()
            return sympy.Rational(token)
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
            if not (n.is_Integer and k.is_Integer and 0 <= n <= 100_000):
                raise NotExact("binomial of non-integers or too large")
            return sympy.binomial(n, k)
        if token == "\\pi":
            self.take()
            return sympy.pi
        if token == "\\infty":
            self.take()
            return sympy.oo
        raise NotExact(f"not a number: {token!r}")


_ATOM_COMMANDS = ("\\frac", "\\sqrt", "\\binom", "\\pi", "\\infty")


def _split_top_level(tokens: list[str], separator: str) -> list[list[str]]:
    """Split `tokens` at `separator` tokens that are not nested in any bracket."""
    parts, current, depth = [], [], 0
    for token in tokens:
        if token in ("(", "[", "{", _UNORDERED_OPEN):
            depth += 1
        elif token in (")", "]", "}", _UNORDERED_CLOSE):
            depth -= 1
        if token == separator and depth == 0:
            parts.append(current)
            current = []
        else:
            current.append(token)
    parts.append(current)
    return parts


def _encloses(tokens: list[str], opens: tuple[str, ...], closes: tuple[str, ...]) -> bool:
    """Whether the first token opens a bracket that the last token closes."""
    if len(tokens) < 2 or tokens[0] not in opens or tokens[-1] not in closes:
        return False
    depth = 0
    for index, token in enumerate(tokens):
        depth += token in ("(", "[", "{", _UNORDERED_OPEN)
        depth -= token in (")", "]", "}", _UNORDERED_CLOSE)
        if depth == 0 and index < len(tokens) - 1:
            return False
    return True


def _element_values(tokens: list[str]) -> list[sympy.Expr]:
    """The values of one element; `a \\pm b` stands for the two values a + b and a - b."""
    parts = _split_top_level(tokens, "\\pm")
    if len(parts) > 2:
        raise NotExact("more than one \\pm")
    if len(parts) == 2:
        left = _evaluate(parts[0]) if parts[0] else sympy.Integer(0)
        right = _evaluate(parts[1])
        return [left + right, left - right]
    return [_evaluate(tokens)]


def _evaluate(tokens: list[str]) -> sympy.Expr:
    if not tokens:
        raise NotExact("empty expression")
    parser = _Parser(tokens)
    value = parser.sum()
    if not parser.done():
        raise NotExact(f"trailing {parser.peek()!r}")
    return value


def parse_exact(normalized: str) -> ExactAnswer:
    """The exact value(s) of a normalised answer; raises NotExact if it is not a numeric one."""
    try:
        return _parse_answer(_tokenize(normalized))
    except RecursionError:
        raise NotExact("nested too deeply") from None


def _parse_answer(tokens: list[str]) -> ExactAnswer:
    if _encloses(tokens, (_UNORDERED_OPEN,), (_UNORDERED_CLOSE,)):
        tokens, brackets = tokens[1:-1], ""
    elif "," in tokens and _encloses(tokens, ("(", "["), (")", "]")):
        tokens, brackets = tokens[1:-1], tokens[0] + tokens[-1]
    else:
        brackets = ""
    elements = _split_top_level(tokens, ",")
    if brackets:
        if any("\\pm" in element for element in elements):
            raise NotExact("\\pm inside a tuple")
        return ExactAnswer(tuple(_evaluate(element) for element in elements), brackets)
    values = [value for element in elements for value in _element_values(element)]
    return ExactAnswer(tuple(values), brackets)
