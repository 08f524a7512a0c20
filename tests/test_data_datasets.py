"""Problem loading from JSONL and parquet, in the flat and the rStar2/DAPO layouts."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rstar2_jax.data.datasets import Problem, load_problems, save_problems
from rstar2_jax.toy.problems import make_splits


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _dapo_row(question, answer):
    return {
        "data_source": "rstar_dapo",
        "prompt": [{"role": "system", "content": "ignored"}, {"role": "user", "content": question}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": "train", "index": 0},
    }


def test_flat_jsonl(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"question": "1+1?", "answer": "2"}\n\n{"question": "3*3?", "answer": 9}\n')
    assert load_problems(path) == [Problem("1+1?", "2"), Problem("3*3?", "9")]


def test_dapo_layout_in_parquet_and_jsonl(tmp_path):
    rows = [_dapo_row("Find x.", "12"), _dapo_row("Find y.", "-3")]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    expected = [Problem("Find x.", "12"), Problem("Find y.", "-3")]
    assert load_problems(tmp_path / "d.parquet") == expected
    assert load_problems(_write_jsonl(tmp_path / "d.jsonl", rows)) == expected


def test_flat_parquet(tmp_path):
    pq.write_table(pa.table({"question": ["a?", "b?"], "answer": ["1", "2"]}), tmp_path / "f.parquet")
    assert load_problems(tmp_path / "f.parquet") == [Problem("a?", "1"), Problem("b?", "2")]


def test_toy_problems_round_trip(tmp_path):
    train, _ = make_splits(20, 0)
    save_problems(tmp_path / "toy.jsonl", train)
    assert load_problems(tmp_path / "toy.jsonl") == [Problem(p.question, p.answer) for p in train]


@pytest.mark.parametrize("bad, message", [
    ("{not json", "invalid JSON"),
    (json.dumps({"question": "q"}), "answer"),
    (json.dumps({"question": "", "answer": "1"}), "question"),
    (json.dumps({"question": "q", "answer": True}), "answer"),
    (json.dumps({"question": "q", "answer": 1.5}), "answer"),
    (json.dumps({"text": "q"}), "needs 'question'"),
    (json.dumps([1, 2]), "expected an object"),
    (json.dumps({"prompt": [{"role": "assistant", "content": "x"}], "reward_model": {"ground_truth": "1"}}), "no user"),
    (json.dumps({"prompt": "q", "reward_model": {"ground_truth": "1"}}), "list of messages"),
    (json.dumps({"prompt": [{"role": "user", "content": "q"}]}), "ground_truth"),
])
def test_malformed_jsonl_row_names_file_and_line(tmp_path, bad, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"question": "ok", "answer": "1"}) + "\n\n" + bad + "\n")
    with pytest.raises(ValueError, match=message) as info:
        load_problems(path)
    assert f"{path}, line 3:" in str(info.value)


def test_malformed_parquet_row_names_file_and_row(tmp_path):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"question": ["a?", "b?", "c?"], "answer": ["1", None, "3"]}), path)
    with pytest.raises(ValueError, match=f"{path}, row 1: the answer"):
        load_problems(path)


def test_unknown_extension(tmp_path):
    with pytest.raises(ValueError, match="unsupported file type"):
        load_problems(tmp_path / "p.csv")
