"""The result of one sandboxed call and the text the model sees for it."""
from __future__ import annotations

import dataclasses
import re
import signal as signal_module

STATUSES = ("ok", "error", "timeout", "memory", "output_limit", "killed", "sandbox_error")


@dataclasses.dataclass(frozen=True)
class ExecResult:
    """Outcome of one call. It crosses process boundaries as JSON (see ``to_dict``), never pickled.

    Attributes:
      status: one of ``STATUSES``:
        ``ok``            the code ran to the end (or ``sys.exit(0)``);
        ``error``         an uncaught exception (traceback in ``stderr``) or a non-zero exit;
        ``timeout``       the wall-clock deadline passed; the call's processes were killed;
        ``memory``        ``MemoryError`` (the address-space limit was hit);
        ``output_limit``  stdout or stderr exceeded the byte cap; the call was killed;
        ``killed``        the process died from a signal it did not get from the pool
                          (segfault, C-stack overflow, CPU-time limit, ...);
        ``sandbox_error`` the pool could not run the call (worker died, pool closed, ...).
      stdout, stderr: the captured streams, decoded as UTF-8 with invalid bytes replaced,
        at most ``output_limit_bytes`` each.
      wall_s: seconds from the call's start to its end (exit or kill).
      cpu_s: user + system CPU seconds of the call's main process.
      exit_code: the exit status when the process exited normally, else None.
      signal: the number of the signal that ended the process, else None.
      stdout_truncated, stderr_truncated: the stream hit the byte cap.
      detail: a short human-readable note for non-``ok`` statuses (empty when there is none).
    """

    status: str
    stdout: str = ""
    stderr: str = ""
    wall_s: float = 0.0
    cpu_s: float = 0.0
    exit_code: int | None = None
    signal: int | None = None
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    detail: str = ""

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"unknown status {self.status!r}; expected one of {STATUSES}")

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ExecResult":
        return cls(**d)


def sandbox_error(detail: str) -> ExecResult:
    return ExecResult(status="sandbox_error", detail=detail)


def _failure_reason(result: ExecResult) -> str | None:
    """The ``reason:`` line of a failed call; None when stderr already says it (a traceback)."""
    if result.status == "error":
        if result.exit_code not in (None, 1):
            return f"exit code {result.exit_code}"
        return None
    if result.status == "killed" and result.signal is not None:
        try:
            name = signal_module.Signals(result.signal).name
        except ValueError:
            name = str(result.signal)
        return f"killed by signal {name}"
    return {
        "timeout": "timeout",
        "memory": "memory limit exceeded",
        "output_limit": "output limit exceeded",
        "sandbox_error": "sandbox error",
    }.get(result.status, result.status) + (f" ({result.detail})" if result.detail else "")


def _strip_one_newline(text: str) -> str:
    return text[:-1] if text.endswith("\n") else text


def truncate_middle(text: str, max_chars: int) -> str:
    """Keep the head and tail of ``text`` so that the result is at most ``max_chars`` long."""
    if len(text) <= max_chars:
        return text
    # The marker's length depends on the count it reports: grow the cut until they agree (the
    # count only grows, so this stops after a step or two).
    cut = len(text) - max_chars
    while True:
        marker = f"\n...({cut} chars truncated)...\n"
        needed = len(text) - max_chars + len(marker)
        if needed == cut:
            break
        cut = needed
    keep = max_chars - len(marker)
    if keep < 2:
        raise ValueError(f"max_chars={max_chars} is too small to hold the truncation marker")
    head = (keep + 1) // 2
    return text[:head] + marker + text[len(text) - (keep - head):]


def render_result(result: ExecResult, max_chars: int = 1024, show_time: bool = True) -> str:
    """The text the model sees inside ``<tool_response>``, in rStar2's format.

    Lines, joined by ``\\n``::

        Tool call success | Tool call failure
        reason: <why>                  (failures only, when stderr does not already say it:
                                        timeout, memory limit exceeded, output limit exceeded,
                                        killed by signal SIGSEGV, exit code 3, sandbox error)
        stdout: <stdout>               (only if non-empty)
        stderr: <stderr>               (only if non-empty; tracebacks land here)
        execution time: 0.12s          (omitted when show_time=False)

    A single trailing newline of each stream is dropped. If the whole text is longer than
    ``max_chars`` the middle is cut and replaced by ``...(N chars truncated)...`` so that the
    first and the last lines (success flag and time) survive. rStar2's executor cut each stream
    to its first 1000 characters and verl then cut the tool response to 256 characters
    (middle); pick ``max_chars`` in the rollout config.
    """
    lines = ["Tool call success" if result.ok else "Tool call failure"]
    if not result.ok:
        reason = _failure_reason(result)
        if reason:
            lines.append(f"reason: {reason}")
    if result.stdout:
        lines.append(f"stdout: {_strip_one_newline(result.stdout)}")
    if result.stderr:
        lines.append(f"stderr: {_strip_one_newline(result.stderr)}")
    if show_time:
        lines.append(f"execution time: {result.wall_s:.2f}s")
    return truncate_middle("\n".join(lines), max_chars)


_TIME_LINE = re.compile(r"\nexecution time: \d+\.\d\ds\Z")
# The stdout line(s) of `render_result`'s text: up to its stderr or time line, or the end.
_STDOUT = re.compile(r"^stdout: (.*?)(?=\nstderr: |\nexecution time: |\Z)", re.MULTILINE | re.DOTALL)


def without_time(rendered: str) -> str:
    """`render_result`'s text without its execution-time line: what a record keeps, so that two
    runs of the same calls write the same bytes."""
    return _TIME_LINE.sub("", rendered)


def rendered_stdout(rendered: str) -> str:
    """The program's stdout as `render_result` showed it ("" when it printed nothing), without
    the stderr and time lines that may follow it. A stdout that itself holds a line starting
    ``stderr: `` is cut there, and a truncated text gives what is left of it."""
    match = _STDOUT.search(rendered)
    return match.group(1) if match else ""
