"""Why a toy tool call failed, how often the correct answers' calls failed for each reason, and
whether a slip in the first call costs correctness.

Three kinds, told apart by the text the model read (``response`` of a call in the evaluation's
per-sample JSONL, `rstar2_jax.evaluate.SampleRecord`):

- ``avoidable``: a ``NameError`` (a misspelt name, a missing import): the demonstrated slips of
  the testbed's session environment and the main job's ``pritn`` typo. A solver can always
  write the call right the first time;
- ``built_in``: ``mod_inverse``'s "base is not invertible", which no solver can avoid (the
  question hides which problems have no inverse, docs/testbed.md);
- ``other``: everything else: a garbled program, a timeout, a malformed call (which includes
  the stateless mix's demonstrated ``wrong_name`` and ``bad_json`` slips: a malformed call shows
  no more of why it failed than a garbled one).

All shares are fractions in [0, 1].
"""
from __future__ import annotations

import re
from typing import Iterable

FAILURE_KINDS = ("avoidable", "built_in", "other")
# The keys of `positive_failures` and `first_call_outcomes` that are shares.
POSITIVE_SHARES = (*FAILURE_KINDS, "positives_with_avoidable")
FIRST_CALL_SHARES = ("slipped", "correct_after_slip", "correct_after_clean")
_NAME_ERROR = re.compile(r"^NameError: name '\w+' is not defined", re.MULTILINE)
_FAILING_LINE = re.compile(r'File "<tool_code>", line (\d+)')


def failure_kind(call: dict) -> str | None:
    """The kind of a failed call (a ``tool_calls`` entry of a sample record); None if it worked."""
    if call["status"] == "ok":
        return None
    response = call["response"]
    if call["status"] == "error" and _NAME_ERROR.search(response):
        return "avoidable"
    if call["status"] == "error" and "base is not invertible" in response:
        return "built_in"
    return "other"


def is_slip(call: dict) -> bool:
    """An avoidable failure on the call's last line: everything before it ran, so one line
    fixes it (a NameError earlier in a call is a garbled program, not a slip)."""
    if failure_kind(call) != "avoidable":
        return False
    lines = _FAILING_LINE.findall(call["response"])
    return bool(lines) and int(lines[-1]) == len(call["code"].splitlines())


def positive_failures(records: Iterable[dict]) -> dict | None:
    """Over the correct samples (reward 1) of an evaluation: the failed calls of each kind over
    all their calls (the paper's error ratio among positives, split by kind), the calls and
    positives counted, and the share of positives with at least one avoidable failure.

    None when no correct sample called the tool, or when the records predate the ``response``
    field (nothing to classify, which is not 0).
    """
    positives = [r for r in records if r["reward"] == 1]
    calls = [c for r in positives for c in r["tool_calls"]]
    if not calls or any("response" not in c for c in calls):
        return None
    kinds = [failure_kind(c) for c in calls]
    split = {kind: kinds.count(kind) / len(calls) for kind in FAILURE_KINDS}
    with_avoidable = sum(any(failure_kind(c) == "avoidable" for c in r["tool_calls"]) for r in positives)
    return split | {"calls": len(calls), "positives": len(positives),
                    "positives_with_avoidable": with_avoidable / len(positives)}


def first_call_outcomes(records: Iterable[dict]) -> dict | None:
    """Over the samples that called the tool: the share whose first call slipped (`is_slip`),
    and the share correct among those and among the samples whose first call worked
    (``correct_after_slip``, ``correct_after_clean``; None with no such sample). The
    environment's property is that these two are alike: a slip costs nothing but tokens.
    None when no sample called the tool, or the records predate ``response``."""
    calling = [r for r in records if r["tool_calls"]]
    if not calling or any("response" not in r["tool_calls"][0] for r in calling):
        return None
    slipped = [r["reward"] for r in calling if is_slip(r["tool_calls"][0])]
    clean = [r["reward"] for r in calling if r["tool_calls"][0]["status"] == "ok"]
    return {"samples": len(calling), "slipped": len(slipped) / len(calling),
            "correct_after_slip": sum(slipped) / len(slipped) if slipped else None,
            "correct_after_clean": sum(clean) / len(clean) if clean else None}
