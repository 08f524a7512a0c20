"""What runs inside a call's child, from the fork to ``os._exit``.

Tool semantics (rStar2's stateless ``python_code_with_standard_io``): the code is a fresh
program with ``stdin`` on standard input. If its last statement is a bare expression, it is
evaluated separately and, when it is not None and nothing was printed, its ``repr`` is printed
(as a notebook would show it). An uncaught exception prints a traceback that starts at the
user's code (the runner's own frames are hidden) and names the source ``<tool_code>``.
"""
from __future__ import annotations

import ast
import io
import linecache
import os
import random
import sys
import traceback

from rstar2_jax.sandbox import containment
from rstar2_jax.sandbox.config import SandboxConfig

SOURCE_NAME = "<tool_code>"
# Written to the status fd just before exit, so the template can tell a MemoryError from any
# other failure without parsing stderr. A call that closes the fd or dies first reports nothing
# and is classified from its exit status instead.
STATUS_OK, STATUS_ERROR, STATUS_MEMORY, STATUS_SETUP_FAILED = b"ok", b"error", b"memory", b"setup"

_CALL_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "PYTHONIOENCODING": "utf-8",
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


class _TrackingFileIO(io.FileIO):
    """Raw stdout that remembers whether anything reached it (for the trailing-expression rule).

    Tracking at the raw level also counts ``sys.stdout.buffer.write``; only ``os.write(1, ...)``
    goes unseen.
    """

    wrote = False

    def write(self, b):
        if len(b):
            self.wrote = True
        return super().write(b)


_stdout_raw: _TrackingFileIO | None = None


def _nothing_printed() -> bool:
    try:
        sys.stdout.flush()
    except (OSError, ValueError):  # the code closed or broke stdout: nothing more can be shown
        return False
    return _stdout_raw is not None and not _stdout_raw.wrote


def _reseed_rngs() -> None:
    # Forked children inherit the template's RNG states: without this every call would draw
    # the same "random" numbers from numpy and sympy (``random`` alone reseeds after fork).
    seed = int.from_bytes(os.urandom(8), "little")
    random.seed(seed)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seed % 2**32)
    if "sympy" in sys.modules:
        sys.modules["sympy"].core.random.seed(seed)


def _print_user_traceback(exc: BaseException) -> None:
    tb = exc.__traceback__
    # Skip the runner's frames: the model should see only its own code.
    while tb is not None and tb.tb_frame.f_code.co_filename != SOURCE_NAME:
        tb = tb.tb_next
    if isinstance(exc, SyntaxError):
        tb = None
    traceback.print_exception(type(exc), exc, tb, file=sys.stderr)


def run_code(code: str) -> tuple[int, bytes]:
    """Run ``code`` as a program; return (exit code, status tag). Never raises."""
    linecache.cache[SOURCE_NAME] = (len(code), None, code.splitlines(True), SOURCE_NAME)
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        tree = ast.parse(code, filename=SOURCE_NAME)
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, SOURCE_NAME, "exec"), namespace)
        if last is not None:
            value = eval(compile(last, SOURCE_NAME, "eval"), namespace)
            if value is not None and _nothing_printed():
                print(repr(value))
        return 0, STATUS_OK
    except SystemExit as exc:
        if exc.code is None or exc.code == 0:
            return 0, STATUS_OK
        if isinstance(exc.code, int):
            return exc.code & 0xFF, STATUS_ERROR
        print(exc.code, file=sys.stderr)
        return 1, STATUS_ERROR
    except MemoryError as exc:
        _print_user_traceback(exc)
        return 1, STATUS_MEMORY
    except BaseException as exc:  # the model's code may raise anything, KeyboardInterrupt included
        _print_user_traceback(exc)
        return 1, STATUS_ERROR


def child_main(code: str, stdin_fd: int, stdout_fd: int, stderr_fd: int, status_fd: int,
               config: SandboxConfig, level: str, uid: int, scratch: str | None) -> None:
    """Set up the call's process and run it; never returns.

    Args:
      stdin_fd, stdout_fd, stderr_fd, status_fd: descriptors inherited from the template,
        moved to 0, 1, 2 and 3; every other inherited descriptor is closed so the call cannot
        touch the template's channel or other calls' pipes.
      level: isolation level (see ``containment``); ``uid`` is the call's slot uid (unused at
        level ``none``); ``scratch`` is its working directory for levels without namespaces.
    """
    try:
        containment.prctl(containment.PR_SET_PDEATHSIG, 9)
        os.setsid()
        for src, dst in ((stdin_fd, 0), (stdout_fd, 1), (stderr_fd, 2), (status_fd, 3)):
            os.dup2(src, dst)
        os.closerange(4, os.sysconf("SC_OPEN_MAX"))
        if level == "namespaces":
            scratch = containment.enter_call_namespaces(config.scratch_bytes, uid)
        os.chdir(scratch)
        containment.set_call_limits(config, level)
        if level != "none":
            containment.drop_privileges(uid)
        os.environ.clear()
        os.environ.update(_CALL_ENV, HOME=scratch, TMPDIR=scratch)
        sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)),
                                     encoding="utf-8", errors="replace")
        global _stdout_raw
        _stdout_raw = _TrackingFileIO(1, "w", closefd=False)
        sys.stdout = io.TextIOWrapper(io.BufferedWriter(_stdout_raw), encoding="utf-8",
                                      errors="backslashreplace")
        sys.stderr = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)),
                                      encoding="utf-8", errors="backslashreplace", line_buffering=True)
        _reseed_rngs()
    except BaseException as exc:  # before any user code: the pool's fault, a sandbox error
        os.write(2, f"sandbox setup failed: {exc!r}\n".encode())
        for fd in (status_fd, 3):
            try:
                os.write(fd, STATUS_SETUP_FAILED)
                break
            except OSError:
                continue
        os._exit(1)
    exit_code, status = run_code(code)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # the code closed or broke its own stream; its output is lost
            pass
    try:
        os.write(3, status)
    except OSError:
        pass
    os._exit(exit_code)
