"""SFT demonstrations for the toy task, in the rStar2 message format.

The mixture is deliberately imperfect, so that the SFT policy leaves room for RL:

- ``tool``:       call the tool with the right program, read its output, answer;
- ``typo``:       the first program has a typo (``pritn``) and fails with a traceback; a corrected
                  second call; answer;
- ``wrong_name``: the first call names a tool that does not exist; a corrected call; answer;
- ``bad_json``:   the first call is not valid JSON; a corrected call; answer;
- ``no_tool``:    answer at once with a mental estimate, which is usually wrong.

A problem with a ``naive_code`` (``mod_inverse``) is solved in two calls in every tool style: its
natural program fails and the error says what to run instead. That failure is part of the
solution, not a style: nothing in the question lets a solver avoid it.

Tool outputs are produced the way the sampler produces them during RL: programs run in the
sandbox and are rendered by ``render_result``; malformed calls go through ``parse_tool_call``
and ``malformed_call_response``. A demonstration whose program does not print the reference
answer is an error, never a silently wrong demonstration.
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
from typing import Iterable, Iterator, Sequence

from rstar2_jax import chat
from rstar2_jax.sandbox import ExecResult, Executor, render_result
from rstar2_jax.toy.problems import ToyProblem

STYLES = ("tool", "typo", "wrong_name", "bad_json", "no_tool")


@dataclasses.dataclass(frozen=True)
class DemoMix:
    """Fractions of the demonstration styles (see the module docstring); they must sum to 1.

    ``first_call_error`` is split evenly between ``typo``, ``wrong_name`` and ``bad_json``.
    """

    # A third of the demonstrations skip the tool, so that the SFT policy still skips it ~20-30%
    # of the time at temperature 0.6 (sampling at T < 1 shrinks rare choices): a decision RL
    # learns to fix on every seed. With 15%, the SFT policy skipped it 2-17% of the time,
    # depending on the seed, and the RL gain hung on slowly sharpening its digit copying.
    tool: float = 0.45
    first_call_error: float = 0.2
    no_tool: float = 0.35

    def __post_init__(self):
        fractions = (self.tool, self.first_call_error, self.no_tool)
        if min(fractions) < 0 or abs(sum(fractions) - 1) > 1e-9:
            raise ValueError(f"DemoMix fractions must be >= 0 and sum to 1; got {fractions}")

    def weights(self) -> list[float]:
        """Weights aligned with ``STYLES``."""
        third = self.first_call_error / 3
        return [self.tool, third, third, third, self.no_tool]


@dataclasses.dataclass(frozen=True)
class Demo:
    """One demonstration: ``messages`` is ``[user, assistant, (tool, assistant)*]`` (see
    ``chat.encode_conversation``); ``answer`` is the reference answer of the question."""

    style: str
    answer: str
    messages: tuple[dict, ...]


def make_demos(
    problems: Sequence[ToyProblem],
    executor: Executor,
    mix: DemoMix = DemoMix(),
    seed: int = 0,
    max_chars: int = 1024,
    show_time: bool = True,
) -> list[Demo]:
    """One demonstration per problem, styles drawn from ``mix`` with ``seed``.

    Args:
      problems: toy problems (their ``code`` and ``estimate`` make the demonstrations).
      executor: runs the programs, e.g. a ``SandboxPool``.
      max_chars, show_time: how tool results are rendered; use the RL rollout's settings so
        that SFT and RL show the model the same format.
    """
    rng = random.Random(seed)
    styles = rng.choices(STYLES, weights=mix.weights(), k=len(problems))
    # Every program of every demonstration is submitted before any result is awaited.
    futures = {
        (i, code): executor.submit(code, "")
        for i, (problem, style) in enumerate(zip(problems, styles))
        for code in _programs(problem, style)
    }
    outputs: dict[int, dict[str, str]] = {i: {} for i in range(len(problems))}
    for (i, code), future in futures.items():
        result: ExecResult = future.result()
        _check_result(problems[i], code, result)
        outputs[i][code] = render_result(result, max_chars=max_chars, show_time=show_time)
    return [
        Demo(style, problem.answer, _messages(problem, style, outputs[i]))
        for i, (problem, style) in enumerate(zip(problems, styles))
    ]


def _typo(code: str) -> str:
    return code.replace("print(", "pritn(", 1)


def _solution(problem: ToyProblem) -> list[str]:
    """The programs a solver runs once its calls are well-formed: the natural first program when
    it fails (its error says what to do instead), then the right one."""
    return [problem.naive_code, problem.code] if problem.naive_code else [problem.code]


def _programs(problem: ToyProblem, style: str) -> list[str]:
    if style == "no_tool":
        return []
    solution = _solution(problem)
    return [_typo(solution[0]), *solution] if style == "typo" else solution


def _check_result(problem: ToyProblem, code: str, result: ExecResult) -> None:
    if code == problem.code and not (result.ok and result.stdout.strip() == problem.answer):
        raise RuntimeError(f"the program for {problem.question!r} did not print {problem.answer}: {result}")
    if code != problem.code and result.status != "error":
        raise RuntimeError(f"the failing first program for {problem.question!r} did not fail: {result}")


def _messages(problem: ToyProblem, style: str, outputs: dict[str, str]) -> tuple[dict, ...]:
    """The conversation; ``outputs`` maps each executed program to its rendered result."""
    def assistant(text):
        return {"role": "assistant", "content": text}

    answer = f"It printed {problem.answer}.</reason>\n<answer>\\boxed{{{problem.answer}}}</answer>"
    messages = [{"role": "user", "content": problem.question}]
    if style == "no_tool":
        messages.append(assistant(
            f"I estimate it.</reason>\n<answer>\\boxed{{{problem.estimate}}}</answer>"))
        return tuple(messages)
    # (call text, tool response) per call; every call but the last fails.
    solution = _solution(problem)
    calls = [(chat.format_tool_call(code), outputs[code]) for code in solution]
    if style == "typo":
        calls.insert(0, (chat.format_tool_call(_typo(solution[0])), outputs[_typo(solution[0])]))
    elif style != "tool":
        bad_call = _malformed_call(solution[0], style)
        call = chat.parse_tool_call(bad_call)
        assert call is not None and call.error is not None, bad_call
        calls.insert(0, (bad_call, chat.malformed_call_response(call)))
    for i, (call, response) in enumerate(calls):
        reason = "I will run Python.</reason>\n" if i == 0 else "That failed; fixing it.</reason>\n"
        messages += [assistant(reason + call), {"role": "tool", "content": response}]
    messages.append(assistant(answer))
    return tuple(messages)


def _malformed_call(code: str, style: str) -> str:
    if style == "wrong_name":
        return chat.format_tool_call(code, name="python")
    # bad_json: the closing brace of the call object is missing.
    good = chat.format_tool_call(code)
    return good[: -len(chat.TOOL_CALL_END) - 1] + chat.TOOL_CALL_END


def corpus(demos: Iterable[Demo], fmt: chat.ChatFormat) -> Iterator[str]:
    """Texts to train a tokenizer on: each prompt, assistant turn and tool scaffold."""
    for demo in demos:
        user, *rest = demo.messages
        yield fmt.prompt_text(user["content"])
        for m in rest:
            yield m["content"] if m["role"] == "assistant" else chat.tool_response_text(m["content"])


def save_demos(path: str | os.PathLike, demos: Iterable[Demo]) -> None:
    """Writes demonstrations as JSONL: ``{"style", "answer", "messages"}`` per line."""
    with open(path, "w") as f:
        for d in demos:
            f.write(json.dumps({"style": d.style, "answer": d.answer, "messages": list(d.messages)}) + "\n")


def load_demos(path: str | os.PathLike) -> list[Demo]:
    """Reads ``save_demos`` output; a malformed line raises ``ValueError`` naming it."""
    demos = []
    with open(path) as f:
        for line_number, line in enumerate(f, start=1):
            try:
                row = json.loads(line)
                demo = Demo(row["style"], row["answer"], tuple(row["messages"]))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}, line {line_number}: not a demonstration ({e!r})") from None
            if demo.style not in STYLES:
                raise ValueError(f"{path}, line {line_number}: unknown style {demo.style!r}")
            demos.append(demo)
    return demos
