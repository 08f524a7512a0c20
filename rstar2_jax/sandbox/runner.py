"""What runs inside a call's child, from the fork to ``os._exit``.

Tool semantics (rStar2's stateless ``python_code_with_standard_io``): the code is a fresh
program with ``stdin`` on standard input. If its last statement is a bare expression, it is
evaluated separately and, when it is not None and nothing was printed, its ``repr`` is printed
(as a notebook would show it). An uncaught exception prints a traceback that starts at the
user's code (the runner's own frames are hidden) and names the source ``<tool_code>``.

A call of a session (``rstar2_jax.sandbox.session``) first replays the session's earlier cells
in the same namespace (sources ``<cell 1>``, ``<cell 2>``, ...), with file descriptors 1 and 2
on ``/dev/null``, each cell's stdin on ``sys.stdin`` and every exception swallowed, then runs its
code as above. What the replayed cells leave behind stays silent (``replay_cells``).
"""
from __future__ import annotations

import ast
import gc
import io
import json
import linecache
import os
import random
import signal
import socket
import sys
import traceback

from rstar2_jax.sandbox import containment, filesystem, seccomp

SOURCE_NAME = "<tool_code>"
# Written to the ready descriptor (fd 3) once the call's process is set up, which is then closed
# before any of the call's code runs: the call can neither fake it nor write to it later. A call
# that never wrote it failed during setup (the pool's fault, a ``sandbox_error``).
READY = b"R"

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
# Streams a replay left to the threads of its cells: kept, so that they are never flushed into
# the new cell's output when they are collected.
_retired_streams: list = []


def _open_stdio() -> tuple[io.TextIOWrapper, io.TextIOWrapper]:
    """New text streams on descriptors 1 and 2, for ``sys.stdout`` and ``sys.stderr`` (stdout
    tracked, for the trailing-expression rule)."""
    global _stdout_raw
    _stdout_raw = _TrackingFileIO(1, "w", closefd=False)
    return (io.TextIOWrapper(io.BufferedWriter(_stdout_raw), encoding="utf-8", errors="backslashreplace"),
            io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)),
                             encoding="utf-8", errors="backslashreplace", line_buffering=True))


class _CallersOnly:
    """A text stream that ignores threads without the call's descriptor: those left by replayed
    cells, whose descriptor table has ``/dev/null`` where the call's has its pipe. Their writes
    are dropped, and so are their flushes, which would send the call's buffered output to
    ``/dev/null``."""

    def __init__(self, stream, fd: int):
        self._stream, self._fd, self._inode = stream, fd, os.fstat(fd).st_ino

    def _callers(self) -> bool:
        try:
            return os.fstat(self._fd).st_ino == self._inode
        except OSError:
            return False

    def write(self, text):
        return self._stream.write(text) if self._callers() else len(text)

    def writelines(self, lines):
        if self._callers():
            self._stream.writelines(lines)

    def flush(self):
        if self._callers():
            self._stream.flush()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _nothing_printed() -> bool:
    try:
        sys.stdout.flush()
    except (OSError, ValueError):  # the code closed or broke stdout: nothing more can be shown
        return False
    return _stdout_raw is not None and not _stdout_raw.wrote


def _reseed_rngs(seed: int | None) -> None:
    # Forked children inherit the template's RNG states: without this every call would draw
    # the same "random" numbers from numpy and sympy (``random`` alone reseeds after fork).
    # A session's calls all start from its seed, so that replayed cells draw what they drew.
    if seed is None:
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


def _flush_stdio() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # the code closed or broke its own stream; its output is lost
            pass


def replay_cells(cells: list[list[str]], namespace: dict) -> None:
    """Run a session's earlier cells ``[[code, stdin], ...]`` in ``namespace``: output to
    ``/dev/null`` (at the descriptor level, so that subprocesses and ``os.write`` are silent
    too), each cell's stdin on ``sys.stdin``, every exception swallowed (a cell that failed
    half-way keeps what it did before the failing line, as in a live kernel).

    What the cells leave behind stays silent in the new cell: the call's descriptors 1 and 2
    are not in the process while the cells run (they wait in a message queued on a socket,
    whose peer is closed, so no descriptor a cell writes to leads to them; only a cell that
    receives that message itself could take them, and only into its own session); the main thread
    takes them back into a descriptor table of its own, so threads the cells started keep
    ``/dev/null``, and their Python-level writes are dropped; interval timers are disarmed;
    their garbage is never collected, so its finalizers never run."""
    if not cells:
        return
    # The call's stdout and stderr travel in a message queued on a socket, outside every
    # descriptor table, while the cells run.
    held, sender = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    socket.send_fds(sender, [b"f"], [1, 2])
    sender.close()
    call_pid, stdin = os.getpid(), sys.stdin
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    os.close(null)
    try:
        for number, (code, cell_stdin) in enumerate(cells, start=1):
            name = f"<cell {number}>"
            linecache.cache[name] = (len(code), None, code.splitlines(True), name)
            sys.stdin = io.TextIOWrapper(io.BytesIO(cell_stdin.encode("utf-8", errors="surrogatepass")),
                                         encoding="utf-8", errors="replace")
            try:
                exec(compile(code, name, "exec"), namespace)
            except BaseException:  # SystemExit and KeyboardInterrupt included: the cell ended there
                pass
            _flush_stdio()  # into /dev/null, before the descriptors are restored
        for timer in (signal.ITIMER_REAL, signal.ITIMER_VIRTUAL, signal.ITIMER_PROF):
            signal.setitimer(timer, 0)
        # What the cells made, garbage included, is never collected in this call: no finalizer
        # of theirs runs in the new cell (a full collection here would cost ~0.3 ms).
        gc.freeze()
        _flush_stdio()
    finally:
        sys.stdin = stdin
        _retired_streams.append((sys.stdout, sys.stderr))
        try:
            if os.getpid() != call_pid:  # a process a replayed cell forked, come this far: stays silent
                raise OSError("not the call's process")
            containment.unshare(containment.CLONE_FILES)
            _, fds, _, _ = socket.recv_fds(held, 1, 2)
            for fd, target in zip(fds, (1, 2)):
                os.dup2(fd, target)
                os.close(fd)
            held.close()
        except OSError:  # a replayed cell broke the hand-back: the new cell's output stays silent
            pass
        out, err = _open_stdio()
        if len(os.listdir("/proc/self/task")) > 1:  # threads of the replayed cells run on
            out, err = _CallersOnly(out, 1), _CallersOnly(err, 2)
        sys.stdout, sys.stderr = out, err


def run_code(code: str, namespace: dict | None = None) -> int:
    """Run ``code`` as a program (in ``namespace``, a session's, or a fresh one); return its exit
    code. Never raises."""
    linecache.cache[SOURCE_NAME] = (len(code), None, code.splitlines(True), SOURCE_NAME)
    if namespace is None:
        namespace = new_namespace()
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
        return 0
    except SystemExit as exc:
        if exc.code is None or exc.code == 0:
            return 0
        if isinstance(exc.code, int):
            return exc.code & 0xFF
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException as exc:  # the model's code may raise anything, KeyboardInterrupt included
        _print_user_traceback(exc)
        return 1


def new_namespace() -> dict:
    return {"__name__": "__main__", "__builtins__": __builtins__}


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def child_main(spec, slot: int, scratch: str | None, code_fd: int, stdin_fd: int, stdout_fd: int,
               stderr_fd: int, ready_fd: int) -> None:
    """Set up the call's process and run it; never returns.

    Args:
      spec: the zygote's ``CallSpec`` (limits, level, slot uids and cgroups, seccomp filter).
      slot: the call's slot; ``scratch`` its working directory for levels without namespaces.
      code_fd: a memfd holding the call's program as JSON: ``{"code", "replay", "seed"}``
        (the code, a session's earlier cells ``[[code, stdin], ...]`` and its seed or null; lone
        surrogates in the code are kept, so compiling them fails in the call as it would for
        any program).
      stdin_fd, stdout_fd, stderr_fd, ready_fd: moved to 0, 1, 2 and 3; every other inherited
        descriptor is closed, and fd 3 is closed after ``READY`` is written to it.
    """
    config, level, uid = spec.config, spec.level, spec.uids[slot]
    try:
        containment.prctl(containment.PR_SET_PDEATHSIG, 9)
        os.setsid()
        # First, so that everything the call allocates or runs, in any process, is charged to its slot.
        for procs_fd in spec.cgroup_procs[slot]:
            os.write(procs_fd, b"0")
        if level == "namespaces":
            containment.setns(spec.netns_fds[slot], containment.CLONE_NEWNET)
        program = json.loads(_read_all(code_fd))
        for src, dst in ((stdin_fd, 0), (stdout_fd, 1), (stderr_fd, 2), (ready_fd, 3)):
            os.dup2(src, dst)
        os.closerange(4, os.sysconf("SC_OPEN_MAX"))
        if level == "namespaces":
            containment.unshare(containment.CLONE_NEWNS | containment.CLONE_NEWIPC)
            scratch = filesystem.enter_call_filesystem(config.scratch_bytes, uid, list(spec.rebind))
        os.chdir(scratch)
        # Under the host's memory pressure the kernel kills calls first, never the trainer
        # before them; set while privileged, so the call cannot lower it again.
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
        containment.set_call_limits(config, level)
        if level != "none":
            containment.drop_privileges(uid)
        containment.set_no_new_privs()
        if spec.seccomp_filter is not None:
            seccomp.install(spec.seccomp_filter)
        os.environ.clear()
        os.environ.update(_CALL_ENV, HOME=scratch, TMPDIR=scratch)
        sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)),
                                     encoding="utf-8", errors="replace")
        sys.stdout, sys.stderr = _open_stdio()
        _reseed_rngs(program["seed"])
        os.write(3, READY)
        os.close(3)
    except BaseException as exc:  # before any user code: the pool's fault, a sandbox error
        os.write(2, f"sandbox setup failed: {exc!r}\n".encode())
        os._exit(1)
    namespace = new_namespace()
    replay_cells(program["replay"], namespace)
    exit_code = run_code(program["code"], namespace)
    _flush_stdio()
    os._exit(exit_code)
