"""SFT demonstrations for the toy task, in the rStar2 message format.

The mixture is deliberately imperfect, so that the SFT policy leaves room for RL:

- ``tool``:       call the tool with the right program, read its output, answer;
- ``typo``:       the first program has a typo (``pritn``) and fails with a traceback; a corrected
                  second call; answer;
- ``wrong_name``: the first call names a tool that does not exist; a corrected call; answer;
- ``bad_json``:   the first call is not valid JSON; a corrected call; answer;
- ``no_tool``:    answer at once with a mental estimate, which is usually wrong.

With a stateful tool (``session=True``, the testbed's session environment, docs/testbed.md) the
calls of a demonstration run in one tool session, in the notebook form of ``ToyProblem``: a first
call binds the numbers to names and computes ``ans`` (it prints nothing), a second prints it
(``print(ans)``). The first-call errors are slips at the end of the first call, after the
numbers and the computation, which the second call, ``print(ans)`` as always, makes good:

- ``typo``:          the first call ends with ``pritn(ans)`` (``NameError: name 'pritn' is not
                     defined``);
- ``misspelt_name``: the first call ends with ``print(answer)`` (``NameError: name 'answer' is
                     not defined``).

A slipped solution thus makes exactly the calls a clean one makes, the same but for a few tokens
at the end of the first: by construction nothing else tells it apart (what the policies make of
that is measured in docs/testbed.md). ``wrong_name`` and ``bad_json`` calls run
nothing, so no state could spare their fix a second copy of the numbers: the session mixture has
none.

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
from rstar2_jax.toy.problems import PRINT_CELL, ToyProblem

STYLES = ("tool", "typo", "wrong_name", "bad_json", "no_tool", "misspelt_name")


@dataclasses.dataclass(frozen=True)
class DemoMix:
    """Fractions of the demonstration styles (see the module docstring); they must sum to 1.

    ``first_call_error`` is split evenly between ``typo``, ``wrong_name`` and ``bad_json``
    (stateless tool), or between ``typo`` and ``misspelt_name`` (sessions).
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

    def weights(self, session: bool = False) -> list[float]:
        """Weights aligned with ``STYLES``, for a stateless tool or for sessions."""
        if session:
            half = self.first_call_error / 2
            return [self.tool, half, 0.0, 0.0, self.no_tool, half]
        third = self.first_call_error / 3
        return [self.tool, third, third, third, self.no_tool, 0.0]


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
    session: bool = False,
) -> list[Demo]:
    """One demonstration per problem, styles drawn from ``mix`` with ``seed``.

    Args:
      problems: toy problems (their programs and ``estimate`` make the demonstrations).
      executor: runs the programs, e.g. a ``SandboxPool``.
      max_chars, show_time: how tool results are rendered; use the RL rollout's settings so
        that SFT and RL show the model the same format.
      session: the programs of a demonstration run in one tool session, in the notebook form
        (``rollout.tool_session``; see the module docstring).
    """
    rng = random.Random(seed)
    styles = rng.choices(STYLES, weights=mix.weights(session), k=len(problems))
    programs = [_programs(problem, style, session) for problem, style in zip(problems, styles)]
    outputs = _run([[code for code, _ in ran] for ran in programs], executor, session)
    demos = []
    for problem, style, ran, results in zip(problems, styles, programs, outputs):
        _check_results(problem, ran, results)
        rendered = [render_result(r, max_chars=max_chars, show_time=show_time) for r in results]
        demos.append(Demo(style, problem.answer,
                          _messages(problem, style, [(code, out) for (code, _), out in zip(ran, rendered)])))
    return demos


def _run(programs: list[list[str]], executor: Executor, session: bool) -> list[list[ExecResult]]:
    """The results of each demonstration's programs, run in order (in one session each with
    ``session``); the i-th programs of all demonstrations run at once."""
    runners = [executor.session() if session and ran else executor for ran in programs]
    outputs: list[list[ExecResult]] = [[] for _ in programs]
    try:
        for i in range(max((len(ran) for ran in programs), default=0)):
            futures = {d: runners[d].submit(ran[i], "") for d, ran in enumerate(programs) if i < len(ran)}
            for d, future in futures.items():
                outputs[d].append(future.result())
    finally:
        for runner in runners:
            if runner is not executor:
                runner.close()
    return outputs


def _typo(code: str) -> str:
    return code.replace("print(", "pritn(", 1)


# The slips of the session styles: a last line of the first call that fails for a misspelt name.
_SLIPS = {"typo": "pritn(ans)", "misspelt_name": "print(answer)"}


def _programs(problem: ToyProblem, style: str, session: bool) -> list[tuple[str, bool]]:
    """Every program of a demonstration, in order, each with whether it must fail (a malformed
    call runs none). The last one prints the answer."""
    if style == "no_tool":
        return []
    if not session:
        # The natural first program when it fails (its error says what to do instead), then the
        # right one; a typo repeats the whole first program.
        solution = [problem.naive_code, problem.code] if problem.naive_code else [problem.code]
        if style == "typo":
            solution = [_typo(solution[0])] + solution
        return [(code, i < len(solution) - 1) for i, code in enumerate(solution)]
    computed = [(problem.compute_cell, False)]
    if problem.naive_expression:
        computed = [(f"{problem.setup}\nans = {problem.naive_expression}", True),
                    (f"{problem.imports}\nans = {problem.expression}", False)]
    if style in _SLIPS:
        computed[-1] = (f"{computed[-1][0]}\n{_SLIPS[style]}", True)
    return computed + [(PRINT_CELL, False)]


def _check_results(problem: ToyProblem, programs: list[tuple[str, bool]], results: list[ExecResult]) -> None:
    """The programs that must fail fail, the others work, and the last prints the answer."""
    for (code, fails), result in zip(programs, results):
        if result.status != ("error" if fails else "ok"):
            raise RuntimeError(f"the program {code!r} for {problem.question!r} should "
                               f"{'fail' if fails else 'work'}: {result}")
    if programs and results[-1].stdout.strip() != problem.answer:
        raise RuntimeError(f"the program for {problem.question!r} did not print {problem.answer}: "
                           f"{results[-1]}")


def _messages(problem: ToyProblem, style: str, ran: list[tuple[str, str]]) -> tuple[dict, ...]:
    """The conversation; ``ran`` holds each executed program and its rendered result, in order."""
    def assistant(text):
        return {"role": "assistant", "content": text}

    answer = f"It printed {problem.answer}.</reason>\n<answer>\\boxed{{{problem.answer}}}</answer>"
    messages = [{"role": "user", "content": problem.question}]
    if style == "no_tool":
        messages.append(assistant(
            f"I estimate it.</reason>\n<answer>\\boxed{{{problem.estimate}}}</answer>"))
        return tuple(messages)
    # (call text, tool response) per call.
    calls = [(chat.format_tool_call(code), output) for code, output in ran]
    if style in ("wrong_name", "bad_json"):
        bad_call = _malformed_call(ran[0][0], style)
        call = chat.parse_tool_call(bad_call)
        assert call is not None and call.error is not None, bad_call
        calls.insert(0, (bad_call, chat.malformed_call_response(call)))
    for i, (call, response) in enumerate(calls):
        if i == 0:
            reason = "I will run Python.</reason>\n"
        elif calls[i - 1][1].startswith("Tool call failure"):
            reason = "That failed; fixing it.</reason>\n"
        else:
            reason = "Now I print it.</reason>\n"
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
