"""The outcome reward: read the final boxed answer and check it against the reference.

- `extract_boxes(text)`: the boxed parts of the final answer; `extract_answer(text)` joins them.
- `is_equivalent(pred, gold)`: answer equivalence (rule-based OR math-verify, exact on numbers).
- `answer_matches(boxes, gold)`: whether boxed parts state the reference (multi-box rule).
- `score(response_text, gold)`: the binary reward, in-process (no timeout).
- `VerifierPool`: the same reward in killable worker processes, with a cache, for training.

None of them raises on any text. The rule is written out in docs/verifier.md.
"""

from rstar2_jax.rewards.extract import extract_answer, extract_boxes
from rstar2_jax.rewards.pool import VerifierPool, VerifierStats
from rstar2_jax.rewards.verify import answer_matches, is_equivalent, score

__all__ = [
    "VerifierPool",
    "VerifierStats",
    "answer_matches",
    "extract_answer",
    "extract_boxes",
    "is_equivalent",
    "score",
]
