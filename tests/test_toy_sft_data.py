"""SFT demonstrations: real sandbox outputs, the rStar2 message format, the style mixture."""
import collections
import concurrent.futures
import json
import re

import pytest
from transformers import AutoTokenizer

from rstar2_jax import chat
from rstar2_jax.data.datasets import load_problems
from rstar2_jax.sandbox import ExecResult, SandboxPool, render_result
from rstar2_jax.toy import TOY_FORMAT, sft_data
from rstar2_jax.toy.build import ToyDataConfig, build_toy_data
from rstar2_jax.toy.demo import sft_seq_len
from rstar2_jax.toy.problems import KINDS, make_splits
from rstar2_jax.toy.tokenizer import build_tokenizer
from rstar2_jax.train.sft_data import Conversations

ALL_STYLES_MIX = sft_data.DemoMix(tool=0.25, first_call_error=0.6, no_tool=0.15)


@pytest.fixture(scope="module")
def pool():
    with SandboxPool(num_workers=2, timeout_s=30.0) as p:
        yield p


@pytest.fixture(scope="module")
def problems():
    return make_splits(40, 0, seed=3)[0]


@pytest.fixture(scope="module")
def demos(pool, problems):
    return sft_data.make_demos(problems, pool, ALL_STYLES_MIX, seed=1, max_chars=400, show_time=False)


class _Answers:
    """A stand-in executor that knows the toy programs: right ones print the answer, typos fail."""

    def __init__(self, problems, wrong=False):
        self.by_code = {p.code: p.answer for p in problems}
        self.wrong = wrong
        self.calls = 0

    def submit(self, code, stdin=""):
        self.calls += 1
        future = concurrent.futures.Future()
        if code in self.by_code:
            answer = self.by_code[code] + ("1" if self.wrong else "")
            future.set_result(ExecResult("ok", stdout=answer + "\n"))
        else:
            future.set_result(ExecResult("error", stderr="NameError: name 'pritn' is not defined", exit_code=1))
        return future


def test_every_style_appears_and_conversations_encode(demos):
    assert {d.style for d in demos} == set(sft_data.STYLES) - {"misspelt_name"}  # sessions only
    tokenizer = build_tokenizer(sft_data.corpus(demos, TOY_FORMAT), vocab_size=800)
    for demo in demos:
        ids, mask = chat.encode_conversation(tokenizer, demo.messages, TOY_FORMAT)
        assert 40 <= len(ids) <= 350, (demo.style, len(ids))  # a tokenizer fit on 40 demos
        assert sum(mask) > 0


def test_correct_calls_show_real_sandbox_output(demos, pool):
    for demo in demos:
        if demo.style == "no_tool":
            continue
        *_, call_turn, tool_turn, answer_turn = demo.messages
        call = chat.parse_tool_call(call_turn["content"])
        assert call.error is None
        expected = render_result(pool.run(call.code, call.stdin), max_chars=400, show_time=False)
        assert tool_turn["content"] == expected == f"Tool call success\nstdout: {demo.answer}"
        assert answer_turn["content"].endswith(f"<answer>\\boxed{{{demo.answer}}}</answer>")
        assert chat.count_answer_blocks(answer_turn["content"]) == 1


def test_first_call_errors_are_seen_by_the_model(demos):
    for demo in demos:
        if demo.style not in ("typo", "wrong_name", "bad_json"):
            continue
        roles = [m["role"] for m in demo.messages]
        assert roles == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
        first_call = chat.parse_tool_call(demo.messages[1]["content"])
        error_text = demo.messages[2]["content"]
        assert error_text.startswith("Tool call failure\n")
        if demo.style == "typo":
            assert first_call.error is None and "pritn" in first_call.code
            assert "NameError" in error_text and "Traceback" in error_text
        else:
            assert first_call.error is not None
            assert error_text == chat.malformed_call_response(first_call)
        assert chat.parse_tool_call(demo.messages[3]["content"]).error is None


def test_an_intrinsic_failure_is_in_every_tool_style(pool):
    """A mod_inverse problem without an inverse: every demonstration that uses the tool runs the
    natural program, sees the real ValueError, then runs the gcd; the styles' own failures come
    before it."""
    problems = [p for p in make_splits(60, 0, seed=2, kinds=["mod_inverse"])[0] if p.naive_code][:12]
    demos = sft_data.make_demos(problems, pool, ALL_STYLES_MIX, seed=4, max_chars=400, show_time=False)
    assert {d.style for d in demos} > {"tool", "typo"}
    for problem, demo in zip(problems, demos):
        if demo.style == "no_tool":
            continue
        calls = [chat.parse_tool_call(m["content"]) for m in demo.messages[1:-1:2]]
        responses = [m["content"] for m in demo.messages[2::2]]
        assert calls[-2].code == problem.naive_code and calls[-1].code == problem.code
        assert "not invertible" in responses[-2] and responses[-2].startswith("Tool call failure")
        assert responses[-1] == f"Tool call success\nstdout: {problem.answer}"
        assert len(calls) == (2 if demo.style == "tool" else 3)


@pytest.fixture(scope="module")
def session_demos(pool):
    problems = make_splits(60, 0, seed=5, kinds=list(KINDS))[0]
    return problems, sft_data.make_demos(problems, pool, ALL_STYLES_MIX, seed=2, max_chars=400,
                                         show_time=False, session=True)


def test_session_demos_slip_at_the_end_of_the_first_call_and_print_ans_next(session_demos, pool):
    """With sessions, every tool demonstration computes ``ans`` in its first call (numbers bound
    to names) and prints it with ``print(ans)`` in its last; a slip is a misspelt name on the
    first call's last line, so a slipped demonstration makes the same calls as a clean one, the
    first with one more line. Replaying the calls in a fresh session gives the answer."""
    problems, demos = session_demos
    assert {d.style for d in demos} == {"tool", "typo", "misspelt_name", "no_tool"}
    for problem, demo in zip(problems, demos):
        if demo.style == "no_tool":
            continue
        calls = [chat.parse_tool_call(m["content"]) for m in demo.messages[1:-1:2]]
        responses = [m["content"] for m in demo.messages[2::2]]
        assert all(c.error is None for c in calls)
        assert calls[-1].code == "print(ans)" and responses[-1] == f"Tool call success\nstdout: {problem.answer}"
        assert all(n in calls[0].code for n in re.findall(r"\d{3,}", problem.question))
        assert len(calls) == 2 + bool(problem.naive_expression)
        computed = calls[-2].code.split("\n")
        if demo.style == "tool":
            assert computed[-1].startswith("ans = ") and responses[-2] == "Tool call success"
        else:
            slip = {"typo": "pritn(ans)", "misspelt_name": "print(answer)"}[demo.style]
            assert computed[-1] == slip and computed[-2].startswith("ans = ")
            name = slip.split("(")[0] if demo.style == "typo" else "answer"
            assert f"NameError: name '{name}' is not defined" in responses[-2]
        with pool.session() as session:
            results = [session.run(c.code) for c in calls]
        assert results[-1].stdout.strip() == problem.answer


def test_stateless_demos_do_not_change_with_the_session_programs(problems, pool):
    """The notebook form is a second form of each problem's program: the stateless
    demonstrations run exactly ``code`` (and its typo), never the notebook form."""
    demos = sft_data.make_demos(problems, _Answers(problems), sft_data.DemoMix(0.5, 0.5, 0.0), seed=3)
    for problem, demo in zip(problems, demos):
        codes = [chat.parse_tool_call(m["content"]).code for m in demo.messages[1:-1:2]
                 if chat.parse_tool_call(m["content"]).error is None]
        assert codes[-1] == problem.code and "ans" not in codes[-1]


def test_no_tool_demos_answer_the_estimate_at_once(demos, problems):
    by_answer = {p.answer: p for p in problems}
    for demo in demos:
        if demo.style == "no_tool":
            (_, turn) = demo.messages
            assert chat.parse_tool_call(turn["content"]) is None
            estimate = by_answer[demo.answer].estimate
            assert turn["content"].endswith(f"<answer>\\boxed{{{estimate}}}</answer>")


def test_mixture_fractions_are_followed():
    problems = make_splits(3000, 0, seed=4)[0]
    demos = sft_data.make_demos(problems, _Answers(problems), sft_data.DemoMix(0.5, 0.3, 0.2), seed=0)
    counts = collections.Counter(d.style for d in demos)
    assert abs(counts["tool"] / 3000 - 0.5) < 0.03
    assert abs(counts["no_tool"] / 3000 - 0.2) < 0.03
    for style in ("typo", "wrong_name", "bad_json"):
        assert abs(counts[style] / 3000 - 0.1) < 0.02


def test_same_seed_same_demos_and_no_tool_only_runs_nothing():
    problems = make_splits(50, 0, seed=4)[0]
    first = sft_data.make_demos(problems, _Answers(problems), ALL_STYLES_MIX, seed=9)
    assert first == sft_data.make_demos(problems, _Answers(problems), ALL_STYLES_MIX, seed=9)
    executor = _Answers(problems)
    demos = sft_data.make_demos(problems, executor, sft_data.DemoMix(0, 0, 1))
    assert {d.style for d in demos} == {"no_tool"} and executor.calls == 0


def test_a_program_that_prints_a_wrong_answer_is_an_error():
    problems = make_splits(5, 0, seed=4)[0]
    with pytest.raises(RuntimeError, match="did not print"):
        sft_data.make_demos(problems, _Answers(problems, wrong=True), sft_data.DemoMix(1, 0, 0))


@pytest.mark.parametrize("fractions", [(0.5, 0.5, 0.5), (1.2, -0.1, -0.1)])
def test_mix_must_be_a_distribution(fractions):
    with pytest.raises(ValueError, match="sum to 1"):
        sft_data.DemoMix(*fractions)


def test_save_load_round_trip_and_bad_line(tmp_path, demos):
    sft_data.save_demos(tmp_path / "sft.jsonl", demos)
    assert sft_data.load_demos(tmp_path / "sft.jsonl") == demos
    (tmp_path / "bad.jsonl").write_text(json.dumps({"style": "tool", "answer": "1", "messages": []})
                                        + "\n" + json.dumps({"style": "tool"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl, line 2"):
        sft_data.load_demos(tmp_path / "bad.jsonl")


def test_build_toy_data_directory(tmp_path, pool):
    config = ToyDataConfig(n_train=30, n_test=10, n_sft=20, vocab_size=800)
    build_toy_data(tmp_path, config, pool)
    train, test = load_problems(tmp_path / "train.jsonl"), load_problems(tmp_path / "test.jsonl")
    assert (len(train), len(test)) == (30, 10)
    assert not {p.question for p in train} & {p.question for p in test}
    demos = sft_data.load_demos(tmp_path / "sft.jsonl")
    assert [d.messages[0]["content"] for d in demos] == [p.question for p in train[:20]]
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "tokenizer")
    for demo in demos:
        ids, _ = chat.encode_conversation(tokenizer, demo.messages, TOY_FORMAT)
        assert tokenizer.decode(ids).count(chat.IM_END) == len(demo.messages) + 1


def test_n_sft_must_fit_in_train():
    with pytest.raises(ValueError, match="n_sft"):
        ToyDataConfig(n_train=10, n_sft=11)


class _Installed(_Answers):
    """Typos fail with a traceback that names a frame of an installation under ``prefix`` (the
    length of a real traceback depends on the Python version and on where Python lives)."""

    def __init__(self, problems, prefix):
        super().__init__(problems)
        self.prefix = prefix

    def submit(self, code, stdin=""):
        future = super().submit(code, stdin)
        if future.result().status == "error":
            future = concurrent.futures.Future()
            future.set_result(ExecResult("error", exit_code=1, stderr=(
                "Traceback (most recent call last):\n  File \"<tool_code>\", line 1, in <module>\n"
                f"  File \"{self.prefix}/lib/python3.12/site-packages/sympy/core/cache.py\", "
                "line 72, in wrapper\nNameError: name 'pritn' is not defined")))
        return future


def test_sft_sequence_length_follows_the_demonstrations(tmp_path, problems):
    prefixes = ("/opt/py", "/home/a-user/.local/share/virtualenvs/an-example-project-3f9c2a1b")
    demos = {p: sft_data.make_demos(problems, _Installed(problems, p), ALL_STYLES_MIX, seed=1,
                                    show_time=False) for p in prefixes}
    tokenizer = build_tokenizer(sft_data.corpus(demos[prefixes[0]], TOY_FORMAT), vocab_size=800)
    seq_lens = []
    for i, prefix in enumerate(prefixes):
        path = tmp_path / f"sft{i}.jsonl"
        sft_data.save_demos(path, demos[prefix])
        seq_len = sft_seq_len(Conversations(str(path), tokenizer, TOY_FORMAT, 4096), max_len=4096)
        longest = max(len(ids) for ids, _ in Conversations(str(path), tokenizer, TOY_FORMAT, seq_len))
        assert longest <= seq_len < longest + 16
        seq_lens.append(seq_len)
    assert seq_lens[0] < seq_lens[1]
    with pytest.raises(ValueError, match=r"more than seq_len=64"):  # the model's positions
        Conversations(str(path), tokenizer, TOY_FORMAT, 64)
