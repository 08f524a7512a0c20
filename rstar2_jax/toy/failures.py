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

Why a held-out sample is wrong (`sample_outcome`, `OUTCOMES`): it stopped without an answer,
answered in its head, no call worked, its working program had other numbers than the question's
(miscopied), its answer was not what the program printed (misread), or none of these (another
program).

All shares are fractions in [0, 1].
"""
from __future__ import annotations

import collections
import re
from typing import Iterable, Sequence

from rstar2_jax.rewards.extract import extract_answer
from rstar2_jax.sandbox.result import rendered_stdout

FAILURE_KINDS = ("avoidable", "built_in", "other")
# The keys of `positive_failures` and `first_call_outcomes` that are shares.
POSITIVE_SHARES = (*FAILURE_KINDS, "positives_with_avoidable")
FIRST_CALL_SHARES = ("slipped", "correct_after_slip", "correct_after_clean")
OUTCOMES = ("right", "unfinished", "no_tool", "failed_call", "miscopied", "misread", "other_program")
_NUMBER = re.compile(r"\d+")
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


def sample_outcome(record: dict) -> str:
    """One of `OUTCOMES` for a held-out sample record (`rstar2_jax.evaluate.SampleRecord` as JSON),
    the first that applies: ``right`` (reward 1); ``unfinished`` (no ``<answer>``: the budget,
    the turn limit, or a turn with neither); ``no_tool`` (answered without calling the tool);
    ``failed_call`` (no call worked); ``miscopied`` (the last working call's program lacks one
    of the question's numbers, counted with repeats); ``misread`` (the boxed answer is not the
    last working call's printed output); ``other_program``."""
    if record["reward"] == 1:
        return "right"
    if record["finish_reason"] != "answer":
        return "unfinished"
    calls = record["tool_calls"]
    if not calls:
        return "no_tool"
    working = [c for c in calls if c["status"] == "ok"]
    if not working:
        return "failed_call"
    question = collections.Counter(_NUMBER.findall(record["question"]))
    if question - collections.Counter(_NUMBER.findall(working[-1]["code"])):
        return "miscopied"
    if extract_answer(record["response_text"]) != rendered_stdout(working[-1]["response"]).strip():
        return "misread"
    return "other_program"


def outcome_shares(records: Sequence[dict], kinds: Sequence[str] | None = None) -> dict[str, dict[str, float]]:
    """``{group: {outcome: share}}`` of the held-out ``records`` (`sample_outcome`); the group
    ``"all"``, and with ``kinds`` (the kind of each problem, indexed by a record's ``problem``)
    one group per kind. Each group's shares sum to 1."""
    groups: dict[str, list[str]] = {"all": []}
    for record in records:
        outcome = sample_outcome(record)
        groups["all"].append(outcome)
        if kinds is not None:
            groups.setdefault(kinds[record["problem"]], []).append(outcome)
    return {group: {o: outcomes.count(o) / len(outcomes) for o in OUTCOMES}
            for group, outcomes in groups.items() if outcomes}
