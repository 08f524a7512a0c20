"""Problem sets from JSONL or parquet files.

Two row layouts are accepted, in either file type:

- flat: ``{"question": str, "answer": str | int}``;
- rStar2/DAPO (verl) parquet layout: ``{"prompt": [{"role", "content"}, ...],
  "reward_model": {"ground_truth": str | int}}``; the question is the content of the last
  user message, taken as is (the chat format adds its own instructions around it).

A missing or empty file, or a malformed row, raises `DataError` naming the file and the line
(JSONL) or row (parquet).
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from rstar2_jax.errors import DataError


@dataclasses.dataclass(frozen=True)
class Problem:
    """A question and its reference answer (decimal text for integer answers)."""

    question: str
    answer: str


def load_problems(path: str | os.PathLike) -> list[Problem]:
    """All problems of a ``.jsonl`` or ``.parquet`` file, in file order (at least one)."""
    path = os.fspath(path)
    if not path.endswith((".jsonl", ".parquet")):
        raise DataError(f"{path}: unsupported file type; expected .jsonl or .parquet")
    if not os.path.isfile(path):
        raise DataError(f"dataset {path} does not exist")
    if path.endswith(".jsonl"):
        problems = [_parse_row(row, f"{path}, line {where}") for where, row in jsonl_rows(path)]
    else:
        try:
            rows = pq.read_table(path).to_pylist()
        except (OSError, pa.ArrowException) as e:
            raise DataError(f"cannot read {path} as parquet ({e})") from None
        problems = [_parse_row(row, f"{path}, row {i}") for i, row in enumerate(rows)]
    if not problems:
        raise DataError(f"dataset {path} holds no problems")
    return problems


def save_problems(path: str | os.PathLike, problems: Iterable) -> None:
    """Writes dataclass problems (``Problem``, toy problems) as JSONL, one object per line."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for p in problems:
            f.write(json.dumps(dataclasses.asdict(p)) + "\n")


def jsonl_rows(path, what: str = "the dataset"):
    """``(line number, parsed JSON)`` of each non-blank line; DataError names the file and line."""
    try:
        lines = open(path, encoding="utf-8").read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read {what} {path}: {e}") from None
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            yield line_number, json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}, line {line_number}: invalid JSON ({e})") from None


def _parse_row(row, where: str) -> Problem:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected an object, got {type(row).__name__}")
    if "question" in row:
        question, answer = row["question"], row.get("answer")
    elif "prompt" in row:
        question, answer = _last_user_content(row["prompt"], where), _ground_truth(row, where)
    else:
        raise DataError(f"{where}: needs 'question'/'answer' fields or the 'prompt'/'reward_model' layout")
    if not isinstance(question, str) or not question.strip():
        raise DataError(f"{where}: the question must be a non-empty string, got {question!r}")
    return Problem(question=question, answer=_answer_text(answer, where))


def _last_user_content(messages, where: str) -> str:
    if not isinstance(messages, list):
        raise DataError(f"{where}: 'prompt' must be a list of messages, got {type(messages).__name__}")
    users = [m.get("content") for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    if not users:
        raise DataError(f"{where}: 'prompt' has no user message")
    return users[-1]


def _ground_truth(row: dict, where: str):
    reward_model = row.get("reward_model")
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        raise DataError(f"{where}: missing 'reward_model.ground_truth'")
    return reward_model["ground_truth"]


def _answer_text(answer, where: str) -> str:
    # bool is an int subclass; True as an answer is a data error, not 1.
    if isinstance(answer, int) and not isinstance(answer, bool):
        return str(answer)
    if isinstance(answer, str) and answer.strip():
        return answer.strip()
    raise DataError(f"{where}: the answer must be a non-empty string or an integer, got {answer!r}")
