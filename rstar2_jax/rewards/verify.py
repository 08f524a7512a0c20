"""Answer equivalence and the binary outcome reward (DESIGN §2b).

The paper's verifier accepts when either a rule-based normaliser or math-verify says equal.
We keep that union but are stricter where math-verify is known to be wrong:

1. equal normal forms (`normalize.py`) -> equal;
2. both sides exact closed-form numbers (`exact.py`) -> exact comparison decides, both ways.
   math-verify rounds to 6 decimals, so it calls 1/2004! and 1/2006! equal;
3. an answer with `\\pm` that step 2 could not read -> not equal (math-verify drops the sign
   set in some directions and would accept `2021` for `\\pm 2021`);
4. otherwise math-verify, gold first (`verify` is not symmetric), with the gold wrapped in
   `\\boxed{}` as rStar2 does; if both of its parses are exact numbers we again compare
   exactly rather than let it round.

Everything here runs in the calling process with math-verify's own timeouts disabled (they are
SIGALRM-based and break off the main thread). Some inputs make sympy grind on huge integers in
C code, which nothing in-process can interrupt: the trainer scores through `VerifierPool`,
which kills such calls from outside.
"""

import logging

import math_verify
import sympy

from rstar2_jax.rewards.exact import NotExact, parse_exact, same_value
from rstar2_jax.rewards.extract import extract_answer
from rstar2_jax.rewards.normalize import normalize_answer

# rStar2's extraction configs: the gold is LaTeX; the prediction may also be a plain expression.
_GOLD_CONFIG = (math_verify.LatexExtractionConfig(),)
_PRED_CONFIG = (math_verify.ExprExtractionConfig(), math_verify.LatexExtractionConfig())

# math-verify warns on every call that its timeouts are disabled; we time out from outside.
logging.getLogger("math_verify").setLevel(logging.ERROR)


def _is_exact_number(value: object) -> bool:
    return (
        isinstance(value, sympy.Expr)
        and value.is_number
        and not value.has(sympy.Float)
        and value.is_finite is True
    )


def _math_verify_equal(pred: str, gold: str) -> bool:
    gold_parsed = math_verify.parse(
        f"\\boxed{{{gold}}}", _GOLD_CONFIG, parsing_timeout=None, raise_on_error=False
    )
    pred_parsed = math_verify.parse(
        f"\\boxed{{{pred}}}", _PRED_CONFIG, parsing_timeout=None, raise_on_error=False
    )
    if not gold_parsed or not pred_parsed:
        return False
    if _is_exact_number(gold_parsed[0]) and _is_exact_number(pred_parsed[0]):
        return same_value(gold_parsed[0], pred_parsed[0])
    return math_verify.verify(gold_parsed, pred_parsed, timeout_seconds=None, raise_on_error=False)


def is_equivalent(pred: str, gold: str) -> bool:
    """Whether the answer `pred` means the same as the reference answer `gold`.

    Both are answer strings (e.g. the content of a `\\boxed{}`), not whole responses.
    Runs in-process without a timeout: see the module docstring.
    """
    pred_normal, gold_normal = normalize_answer(pred), normalize_answer(gold)
    if not pred_normal or not gold_normal:
        return False
    if pred_normal == gold_normal:
        return True
    try:
        return parse_exact(pred_normal).equals(parse_exact(gold_normal))
    except NotExact:
        pass
    if "\\pm" in pred_normal or "\\pm" in gold_normal:
        return False
    return _math_verify_equal(pred, gold)


def score(response_text: str, gold: str) -> float:
    """The binary reward of a response: 1.0 if its final boxed answer equals `gold`, else 0.0.

    In-process and unprotected (a pathological answer can hang it); for notebooks and tests.
    Training uses `VerifierPool.score_batch`, which has the same semantics plus a hard timeout.
    """
    answer = extract_answer(response_text)
    return float(answer is not None and is_equivalent(answer, gold))
