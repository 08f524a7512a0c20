"""The outcome reward: extract the final boxed answer and check it against the reference.

- `extract_answer(text)`: the answer string a response commits to, or None.
- `is_equivalent(pred, gold)`: answer equivalence (rule-based OR math-verify, exact on numbers).
- `score(response_text, gold)`: the binary reward, in-process (no timeout).
- `VerifierPool`: the same reward in killable worker processes, with a cache, for training.
"""

from rstar2_jax.rewards.extract import extract_answer
from rstar2_jax.rewards.pool import VerifierPool, VerifierStats
from rstar2_jax.rewards.verify import is_equivalent, score

__all__ = ["VerifierPool", "VerifierStats", "extract_answer", "is_equivalent", "score"]
