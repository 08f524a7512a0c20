"""The answer-checking code, imported and run once: what a verifier worker does before its
first call. Imported by the verifier pool's fork server before it forks any worker (sympy
imports much of itself lazily, on first use), so that each worker starts warm in a fraction of
a second instead of importing sympy and math-verify for seconds; a worker imports it too, which
costs nothing where the server already did."""
from rstar2_jax.rewards.extract import extract_boxes
from rstar2_jax.rewards.verify import answer_matches

answer_matches(extract_boxes("<answer>\\boxed{\\frac{2}{4}}</answer>"), "0.5")
answer_matches(["x^2 - 1"], "(x-1)(x+1)")
